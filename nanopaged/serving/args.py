"""The command line of the server, read before anything heavy is imported (so that
`--help` and a wrong flag answer at once): `nanopaged serve MODEL [options]` (`cli.py`),
`python -m nanopaged.serving.server MODEL [options]` and vLLM's `python -m
nanopaged.entrypoints.openai.api_server --model MODEL [options]` all take these
arguments."""

import argparse
import json

from nanopaged.engine.arg_utils import EngineArgs, FlexibleArgumentParser

DESCRIPTION = (
    "Serve a model behind an OpenAI-compatible HTTP API (/v1/completions, "
    "/v1/chat/completions, /v1/models, /tokenize, /metrics, ...), as `vllm serve` "
    "does. Clients name the model by --served-model-name (default: MODEL)."
)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = FlexibleArgumentParser(prog="nanopaged serve", description=DESCRIPTION)
    parser.add_argument(
        "model_tag",
        nargs="?",
        metavar="MODEL",
        help="a checkpoint directory or a Hugging Face id (or --model)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="(default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="(default: 8000)")
    parser.add_argument(
        "--max-waiting",
        type=int,
        default=256,
        help="requests that may wait for their first token; more get 503 at once "
        "(default: 256)",
    )
    parser.add_argument(
        "--router",
        choices=["prefix", "least"],
        default="prefix",
        help="with --data-parallel-size: send a request to the replica that was "
        "sent its prompt's longest prefix, unless it is much busier than "
        "the least busy (prefix), or always to the least busy (least)",
    )
    parser.add_argument(
        "--served-model-name",
        help="the model's name in the API, which requests must give as `model` "
        "(default: MODEL)",
    )
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        type=lora_module,
        metavar="NAME=PATH",
        help="with --enable-lora: LoRA adapters (peft's format) served as models "
        'of their names: NAME=PATH, or JSON {"name": ..., "path": ..., '
        '"base_model_name": ...}',
    )
    parser.add_argument(
        "--log-level",
        default="info",
        help="uvicorn's; warning hides each request (default: info)",
    )
    EngineArgs.add_cli_args(parser.add_argument_group("engine options"))
    args = parser.parse_args(argv)
    args.model = args.model_tag or args.model
    if args.lora_modules and not args.enable_lora:
        parser.error("--lora-modules needs --enable-lora")
    taken = {args.served_model_name or args.model}  # the names clients ask for
    for name, _, _ in args.lora_modules or ():
        if name in taken:
            parser.error(
                f"--lora-modules: the name {name!r} is taken (by the served "
                f"model, or another adapter): each model needs its own name"
            )
        taken.add(name)
    return args


def lora_module(text: str) -> tuple[str, str, str | None]:
    """vLLM's --lora-modules item: NAME=PATH or a JSON object -> (name, path, base
    model)."""
    if text.lstrip().startswith("{"):
        try:
            item = json.loads(text)
        except json.JSONDecodeError as error:
            raise argparse.ArgumentTypeError(f"not valid JSON: {error}") from None
        if not (
            isinstance(item, dict)
            and isinstance(item.get("name"), str)
            and isinstance(item.get("path"), str)
        ):
            raise argparse.ArgumentTypeError(
                f'{text!r}: a JSON item needs "name" and "path"'
            )
        return item["name"], item["path"], item.get("base_model_name")
    name, equals, path = text.partition("=")
    if not (name and equals and path):
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=PATH")
    return name, path, None
