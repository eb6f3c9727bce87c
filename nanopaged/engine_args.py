"""Every option of `LLM(model, **options)`, as vLLM's `EngineArgs` and its command-line flags.

`OPTIONS` lists them all, in the order `--help` shows them: the core's (checked by `Config`),
scaling out's (`ParallelConfig`), the vLLM surface's own (`tokenizer`, `generation_config`,
`structured_outputs_config`, `speculative_config`, checked where they are used), vLLM's mere
hints, accepted and ignored, and vLLM's aliases. An option nobody defines is a ValueError naming
it. This module imports nothing heavy, so that `--help` answers at once.
"""
import argparse
import dataclasses
import difflib
import json
import sys
from typing import get_args

# name -> (type, default, what it does); the README's options table says the same
OPTIONS = {
    "model": (str, "Qwen/Qwen3-0.6B", "a checkpoint directory or a Hugging Face id"),
    "tokenizer": (str | None, None, "take the tokenizer from this directory or id instead"),
    "tokenizer_mode": (str, "auto", "auto: the fast tokenizer (tokenizer.json), the only one "
                                    "nanopaged loads"),
    "device": (str | None, None, "cuda or cpu (default: cuda if available)"),
    "dtype": (str | None, None, "auto (the checkpoint's on GPU, float32 on CPU), float32/float, "
                                "float16/half, bfloat16"),
    "max_num_batched_tokens": (int | None, None, "token budget of one step (default: 16384 on "
                                                 "a GPU, 4096 on a CPU); longer prompts are "
                                                 "prefilled in chunks"),
    "max_num_seqs": (int, 512, "sequences running at once"),
    "max_model_len": (int | None, None, "longest prompt + completion (default: the model's)"),
    "gpu_memory_utilization": (float, 0.9, "share of GPU memory the engine may use"),
    "kvcache_block_size": (int | None, None, "tokens per KV-cache block (default: 256 with "
                                             "flash-attn, else 16)"),
    "num_kvcache_blocks": (int | None, None, "force the KV pool's size (default: sized from "
                                             "free memory)"),
    "enforce_eager": (bool, False, "no CUDA graphs"),
    "attention_backend": (str, "auto", "auto, torch, triton or flash"),
    "scheduling": (str, "prefill-first", "prefill-first, or mixed: decode everyone each step, "
                                         "fill the rest with prompt chunks"),
    "kv_cache_dtype": (str, "auto", "auto (the model's dtype), or fp8 / fp8_e4m3: K/V stored in "
                                    "e4m3, half a bfloat16 cache's bytes (not with flash-attn)"),
    "enable_prefix_caching": (bool, True, "reuse the K/V of prompt prefixes seen before"),
    "enable_chunked_prefill": (bool, True, "split prompts longer than the token budget over "
                                           "steps"),
    "seed": (int, 0, "seed of the samples of requests that bring no seed of their own"),
    "tensor_parallel_size": (int, 1, "ranks, one process and one GPU each"),
    "distributed_port": (int | None, None, "where the ranks meet on 127.0.0.1 (default: a free "
                                           "port)"),
    "distributed_executor_backend": (str | None, None, "mp (the engine starts its ranks) or "
                                                       "external_launcher (the processes "
                                                       "torchrun started, on any machines)"),
    "data_parallel_size": (int, 1, "replicas of the engine, each with its share of the "
                                   "requests"),
    "generation_config": (str, "auto", "default sampling settings: auto (the checkpoint's), "
                                       "vllm (none), or a directory"),
    "structured_outputs_config": (dict | None, None, "defaults of structured outputs, as JSON: "
                                                     "{\"disable_any_whitespace\": true}"),
    "speculative_config": (dict | None, None, "speculative decoding, as JSON: {\"method\": "
                                              "\"ngram\", \"num_speculative_tokens\": 4} or "
                                              "{\"model\": DRAFT, ...}"),
    "enable_lora": (bool, False, "serve LoRA adapters: a request's lora_request (peft's "
                                 "format) adapts the model for it alone"),
    "max_loras": (int, 1, "LoRA adapters in one step (their device slots)"),
    "max_lora_rank": (int, 16, "the highest rank of a LoRA adapter"),
    "max_cpu_loras": (int | None, None, "LoRA adapters kept read on the host (default: "
                                        "max_loras)"),
    "trace": (str | None, None, "write a trace of every step here (JSON lines); `python -m "
                                "nanopaged.trace PATH` makes the page that plays it back"),
    "config_format": (str, "auto", "auto or hf: the checkpoint's config.json (mistral's "
                                   "params.json is not read)"),
    "load_format": (str, "auto", "auto or safetensors: the checkpoint's *.safetensors files "
                                 "(not .bin, gguf, ...)"),
    # vLLM options that only tune what nanopaged does not have: checked, then ignored
    "trust_remote_code": (bool, False, "accepted: nanopaged runs no code from a checkpoint"),
    "disable_log_stats": (bool, True, "accepted: nanopaged logs no periodic stats"),
    "swap_space": (float, 4, "accepted: preempted sequences are recomputed, never swapped"),
    # vLLM's older names
    "block_size": (int | None, None, "vLLM's name for --kvcache-block-size"),
    "guided_decoding_backend": (str | None, None, "vLLM's before 0.10: a backend (a hint), with "
                                                  "':disable-any-whitespace' to ask for compact "
                                                  "JSON"),
}
HINTS = ("trust_remote_code", "disable_log_stats", "swap_space")
# vLLM's options whose other values nanopaged does not do: what it does
FORMATS = {"config_format": ("auto", "hf"), "load_format": ("auto", "safetensors")}
ALIASES = {"block_size": "kvcache_block_size"}
SURFACE = ("tokenizer", "tokenizer_mode", "generation_config", "structured_outputs_config",
           "speculative_config", "enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras",
           "trace")


def split_options(model: str, options: dict) -> tuple[dict, dict, dict]:
    """The options of `LLM(model, **options)`, checked by name and type, as the core's (for
    `Config`), scaling out's (for `ParallelConfig`) and the surface's own."""
    from nanopaged.core.config import Config, check_fields  # torch: not before it is needed
    from nanopaged.parallel import ParallelConfig
    for name in set(options) - set(OPTIONS):
        close = difflib.get_close_matches(name, OPTIONS, n=1)
        raise ValueError(f"unknown option {name!r}" + (f"; did you mean {close[0]!r}?" if close
                         else f"; the options are {', '.join(list(OPTIONS)[1:])}"))
    if type(options.get("dtype")).__module__ == "torch":  # a torch.dtype: its name
        options = dict(options, dtype=str(options["dtype"]).removeprefix("torch."))
    check_fields(EngineArgs(model, **options))
    options = _normalize(options)
    core, parallel = ({f.name: options[f.name] for f in dataclasses.fields(cls)
                       if f.init and f.name in options} for cls in (Config, ParallelConfig))
    return core, parallel, {name: options.get(name, OPTIONS[name][1]) for name in SURFACE}


def _normalize(options: dict) -> dict:
    """`LLM(**options)` with vLLM's aliases renamed and its mere hints dropped."""
    for name, values in FORMATS.items():
        if options.get(name, "auto") not in values:
            raise ValueError(f"{name}={options[name]!r} is not supported: nanopaged reads "
                             f"{OPTIONS[name][2].partition(': ')[2]} ({' or '.join(values)})")
    options = {name: value for name, value in options.items()
               if name not in HINTS and name not in FORMATS}
    backend = options.pop("guided_decoding_backend", None)  # vLLM's name before 0.10
    if backend is not None:
        name, _, extra = str(backend).partition(":")
        options["structured_outputs_config"] = dict(
            options.get("structured_outputs_config") or {}, backend=name,
            disable_any_whitespace="disable-any-whitespace" in extra)
    config = options.get("structured_outputs_config")
    if config is not None and (set(config) - {"backend", "disable_any_whitespace"}
                               or not isinstance(config.get("disable_any_whitespace", False),
                                                 bool)):
        raise ValueError(f"structured_outputs_config takes backend and disable_any_whitespace "
                         f"(true or false), got {config!r}")
    for alias, name in ALIASES.items():
        if options.get(alias) is not None:
            if options.get(name) not in (None, options[alias]):
                raise ValueError(f"{alias}={options[alias]} and {name}={options[name]} disagree")
            options[name] = options[alias]
        options.pop(alias, None)
    return options


def _add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds a flag per engine option (--max-model-len, ...), each with its meaning and default."""
    for name, (kind, default, shown) in OPTIONS.items():
        kind = next(t for t in get_args(kind) or (kind,) if t is not type(None))
        flag = "--" + name.replace("_", "-")
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                                help=f"{shown} (default: {default})")
        else:
            parser.add_argument(flag, type=json.loads if kind is dict else kind, default=default,
                                help=shown + (f" (default: {default})" if default is not None
                                              and "default" not in shown else ""))
    return parser


def _from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
    return cls(**{name: getattr(args, name) for name in OPTIONS if hasattr(args, name)})


EngineArgs = dataclasses.make_dataclass(
    "EngineArgs", [(name, kind, dataclasses.field(default=default))
                   for name, (kind, default, _) in OPTIONS.items()],
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
