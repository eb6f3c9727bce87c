"""vLLM's names for what nanopaged already does, so that a script written for vLLM's offline API
runs with only the import changed: `EngineArgs` and its command-line flags, option aliases and
hints, and the engine methods vLLM's examples call. Nothing here changes what the engine does.
"""
import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Iterable
from typing import get_args

import torch

from nanopaged.config import Config
from nanopaged.sampling_params import SamplingParams

# vLLM options that only tune what nanopaged does not have: accepted (type-checked) and ignored
HINTS = {"trust_remote_code": (bool, False, "accepted: nanopaged runs no code from a checkpoint"),
         "disable_log_stats": (bool, True, "accepted: nanopaged logs no periodic stats"),
         "swap_space": ((int, float), 4, "accepted: preempted sequences are recomputed, "
                                         "never swapped")}
ALIASES = {"block_size": "kvcache_block_size"}
GENERATION_SETTINGS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                       "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                       "max_new_tokens": "max_tokens"}
# What each option does, for --help (the README's options table says the same)
HELP = {
    "model": "a checkpoint directory or a Hugging Face id",
    "tokenizer": "take the tokenizer from this directory or id instead",
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


def normalize_options(options: dict) -> dict:
    """`LLM(**options)` with vLLM's aliases renamed and its mere hints checked and dropped."""
    options = dict(options)
    for name, (kind, _, _) in HINTS.items():
        value = options.pop(name, None)
        if value is not None and (not isinstance(value, kind)
                                  or isinstance(value, bool) and kind is not bool):
            raise ValueError(f"{name} must be {getattr(kind, '__name__', 'a number')}, "
                             f"got {value!r}")
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


def generation_defaults(config: Config) -> dict:
    """The sampling settings of the generation config `config.generation_config` names, with
    SamplingParams' names, as vLLM takes them (temperature, top_p, top_k, min_p,
    repetition_penalty, and max_new_tokens as max_tokens)."""
    if config.generation_config == "vllm":
        return {}
    directory = config.model if config.generation_config == "auto" else config.generation_config
    path = os.path.join(directory, "generation_config.json")
    if not os.path.exists(path):
        if config.generation_config != "auto":
            raise ValueError(f"generation_config={directory!r} has no generation_config.json")
        return {}
    with open(path) as f:
        settings = json.load(f)
    return {ours: settings[theirs] for theirs, ours in GENERATION_SETTINGS.items()
            if settings.get(theirs) is not None}


def _engine_args_fields() -> list:
    own = [(f.name, f.type, dataclasses.field(default=f.default))
           for f in dataclasses.fields(Config) if f.init and f.name != "model"]
    hints = [(name, kind if isinstance(kind, type) else float, dataclasses.field(default=default))
             for name, (kind, default, _) in HINTS.items()]
    return [("model", str, dataclasses.field(default="Qwen/Qwen3-0.6B")), *own, *hints,
            ("block_size", int | None, dataclasses.field(default=None)),
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


class FlexibleArgumentParser(argparse.ArgumentParser):
    """vLLM's argument parser: `--max_model_len` means `--max-model-len`."""

    def parse_args(self, args=None, namespace=None):
        def dashed(arg: str) -> str:
            flag, equals, value = arg.partition("=")
            return flag.replace("_", "-") + equals + value if arg.startswith("--") else arg
        return super().parse_args([dashed(a) for a in (sys.argv[1:] if args is None else args)],
                                  namespace)


class VLLMEngineAPI:
    """The methods of vLLM's `LLM` and `LLMEngine` that vLLM's examples call, on nanopaged's
    engine (a mixin of `LLMEngine`)."""

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs):
        return cls(**dataclasses.asdict(engine_args))

    def has_unfinished_requests(self) -> bool:
        return not self.is_finished()

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        for one in [request_id] if isinstance(request_id, str) else request_id:
            self.abort(one)

    def get_tokenizer(self):
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the sampling settings of the checkpoint's generation config
        (unless generation_config="vllm"), as vLLM gives `generate` when none are passed."""
        return SamplingParams(**self.default_sampling)

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix; False (and nothing forgotten) while requests run."""
        return self.block_manager.reset_prefix_cache()

    def start_profile(self) -> None:
        """Starts torch.profiler on this process (rank 0); `stop_profile` writes a Chrome trace
        into $VLLM_TORCH_PROFILER_DIR (or $NANOPAGED_TORCH_PROFILER_DIR)."""
        directory = (os.environ.get("VLLM_TORCH_PROFILER_DIR")
                     or os.environ.get("NANOPAGED_TORCH_PROFILER_DIR"))
        if not directory:
            raise ValueError("start_profile() writes its trace to the directory named by "
                             "VLLM_TORCH_PROFILER_DIR; set it first")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(activities=activities)
        self.profiler.directory = directory
        self.profiler.start()

    def stop_profile(self) -> str:
        """Stops the profiler; returns the trace's path."""
        if getattr(self, "profiler", None) is None:
            raise ValueError("stop_profile() without start_profile()")
        self.profiler.stop()
        os.makedirs(self.profiler.directory, exist_ok=True)
        path = os.path.join(self.profiler.directory, f"nanopaged-{os.getpid()}-{time.time():.0f}"
                                                     f".trace.json")
        self.profiler.export_chrome_trace(path)
        self.profiler = None
        return path
