"""Every option of `LLM(model, **options)`, as vLLM's `EngineArgs` and its command-line flags:
the core's (`Config`), scaling out's (`ParallelConfig`), speculative decoding's, the vLLM
surface's own, and vLLM's aliases and mere hints. Each group is checked where it is defined;
here an option nobody defines is a ValueError naming it.
"""
import argparse
import dataclasses
import difflib
import json
import sys
from typing import get_args

import torch

from nanopaged.core.config import Config, check_fields
from nanopaged.parallel import ParallelConfig

# vLLM options that only tune what nanopaged does not have: accepted (type-checked) and ignored
HINTS = {"trust_remote_code": (bool, False, "accepted: nanopaged runs no code from a checkpoint"),
         "disable_log_stats": (bool, True, "accepted: nanopaged logs no periodic stats"),
         "swap_space": ((int, float), 4, "accepted: preempted sequences are recomputed, "
                                         "never swapped")}
ALIASES = {"block_size": "kvcache_block_size"}
# The vLLM surface's own options: name -> (type, default)
SURFACE = {"tokenizer": (str | None, None), "tokenizer_mode": (str, "auto"),
           "generation_config": (str, "auto"),
           "structured_outputs_config": (dict | None, None),
           "speculative_config": (dict | None, None)}
# What each option does, for --help (the README's options table says the same)
HELP = {
    "model": "a checkpoint directory or a Hugging Face id",
    "tokenizer": "take the tokenizer from this directory or id instead",
    "tokenizer_mode": "auto: the fast tokenizer (tokenizer.json), the only one nanopaged loads",
    "device": "cuda or cpu (default: cuda if available)",
    "dtype": "auto (the checkpoint's on GPU, float32 on CPU), float32/float, float16/half, "
             "bfloat16",
    "max_num_batched_tokens": "token budget of one step; longer prompts are prefilled in chunks",
    "max_num_seqs": "sequences running at once",
    "max_model_len": "longest prompt + completion (default: the model's)",
    "gpu_memory_utilization": "share of GPU memory the engine may use",
    "kvcache_block_size": "tokens per KV-cache block (default: 256 with flash-attn, else 16)",
    "num_kvcache_blocks": "force the KV pool's size (default: sized from free memory)",
    "enforce_eager": "no CUDA graphs",
    "tensor_parallel_size": "ranks, one process and one GPU each",
    "distributed_port": "where the ranks meet on 127.0.0.1 (default: a free port)",
    "distributed_executor_backend": "mp (the engine starts its ranks) or external_launcher "
                                    "(the processes torchrun started, on any machines)",
    "data_parallel_size": "replicas of the engine, each with its share of the requests",
    "attention_backend": "auto, torch, triton or flash",
    "scheduling": "prefill-first, or mixed: decode everyone each step, fill the rest with "
                  "prompt chunks",
    "enable_prefix_caching": "reuse the K/V of prompt prefixes seen before",
    "enable_chunked_prefill": "split prompts longer than the token budget over steps",
    "seed": "seed of the samples of requests that bring no seed of their own",
    "generation_config": "default sampling settings: auto (the checkpoint's), vllm (none), "
                         "or a directory",
    "structured_outputs_config": "defaults of structured outputs, as JSON: "
                                 "{\"disable_any_whitespace\": true}",
    "speculative_config": "speculative decoding, as JSON: {\"method\": \"ngram\", "
                          "\"num_speculative_tokens\": 4} or {\"model\": DRAFT, ...}",
    "block_size": "vLLM's name for --kvcache-block-size",
    "guided_decoding_backend": "vLLM's before 0.10: a backend (a hint), with "
                               "':disable-any-whitespace' to ask for compact JSON",
    **{name: help for name, (_, _, help) in HINTS.items()},
}


def _normalize(options: dict) -> dict:
    """`LLM(**options)` with vLLM's aliases renamed and its mere hints checked and dropped."""
    options = {name: value for name, value in options.items() if name not in HINTS}
    backend = options.pop("guided_decoding_backend", None)  # vLLM's name before 0.10
    if backend is not None:
        name, _, extra = str(backend).partition(":")
        options["structured_outputs_config"] = dict(
            options.get("structured_outputs_config") or {}, backend=name,
            disable_any_whitespace="disable-any-whitespace" in extra)
    config = options.get("structured_outputs_config")
    if config is not None and (not isinstance(config, dict) or set(config) - {
            "backend", "disable_any_whitespace"} or not isinstance(
            config.get("disable_any_whitespace", False), bool)):
        raise ValueError(f"structured_outputs_config takes backend and disable_any_whitespace "
                         f"(true or false), got {config!r}")
    for alias, name in ALIASES.items():
        if options.get(alias) is not None:
            if options.get(name) not in (None, options[alias]):
                raise ValueError(f"{alias}={options[alias]} and {name}={options[name]} disagree")
            options[name] = options[alias]
        options.pop(alias, None)
    return options


def split_options(model: str, options: dict) -> tuple[dict, dict, dict]:
    """The options of `LLM(model, **options)`, checked by name and type, as the core's (for
    `Config`), scaling out's (for `ParallelConfig`) and the surface's own."""
    names = [f.name for f in dataclasses.fields(EngineArgs)]
    for name in set(options) - set(names):
        close = difflib.get_close_matches(name, names, n=1)
        raise ValueError(f"unknown option {name!r}" + (f"; did you mean {close[0]!r}?" if close
                         else f"; the options are {', '.join(names[1:])}"))
    check_fields(EngineArgs(model, **options))
    options = _normalize(options)
    groups = [[f.name for f in dataclasses.fields(cls) if f.init] for cls in (Config,
                                                                             ParallelConfig)]
    core, parallel = ({name: options[name] for name in group if name in options}
                      for group in groups)
    surface = {name: options.get(name, default) for name, (_, default) in SURFACE.items()}
    return core, parallel, surface


def _engine_args_fields() -> list:
    own = [(f.name, f.type, dataclasses.field(default=f.default))
           for cls in (Config, ParallelConfig) for f in dataclasses.fields(cls)
           if f.init and f.name != "model"]
    surface = [(name, kind, dataclasses.field(default=default))
               for name, (kind, default) in SURFACE.items()]
    hints = [(name, kind if isinstance(kind, type) else float, dataclasses.field(default=default))
             for name, (kind, default, _) in HINTS.items()]
    return [("model", str, dataclasses.field(default="Qwen/Qwen3-0.6B")), surface[0], *own,
            *surface[1:], *hints, ("block_size", int | None, dataclasses.field(default=None)),
            ("guided_decoding_backend", str | None, dataclasses.field(default=None))]


def _add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds a flag per engine option (--max-model-len, ...), each with its meaning and default."""
    for f in dataclasses.fields(EngineArgs):
        kind = next(t for t in get_args(f.type) or (f.type,) if t is not type(None))
        kind = {torch.dtype: str, dict: json.loads}.get(kind, kind)
        flag, shown = "--" + f.name.replace("_", "-"), HELP.get(f.name, "")
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default,
                                help=f"{shown} (default: {f.default})")
        else:
            parser.add_argument(flag, type=kind, default=f.default, help=shown + (
                f" (default: {f.default})" if f.default is not None and "default" not in shown
                else ""))
    return parser


def _from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
                  if hasattr(args, f.name)})


EngineArgs = dataclasses.make_dataclass(
    "EngineArgs", _engine_args_fields(),
    namespace={"__doc__": "vLLM's EngineArgs: every option of `LLM(model, **options)`, and its "
                          "command-line flags. `LLM(**dataclasses.asdict(args))` takes them.",
               "add_cli_args": staticmethod(_add_cli_args),
               "from_cli_args": classmethod(_from_cli_args)})
EngineArgs.__module__ = __name__


class FlexibleArgumentParser(argparse.ArgumentParser):
    """vLLM's argument parser: `--max_model_len` means `--max-model-len`."""

    def parse_args(self, args=None, namespace=None):
        def dashed(arg: str) -> str:
            flag, equals, value = arg.partition("=")
            return flag.replace("_", "-") + equals + value if arg.startswith("--") else arg
        return super().parse_args([dashed(a) for a in (sys.argv[1:] if args is None else args)],
                                  namespace)
