"""Every option of `LLM(model, **options)`, as vLLM's `EngineArgs` and its command-line
flags.

`OPTIONS` lists them all, in the order `--help` shows them: the core's (checked by
`Config`), scaling out's (`ParallelConfig`), the vLLM surface's own (`tokenizer`,
`generation_config`, `structured_outputs_config`, `speculative_config`, checked where
they are used), vLLM's mere hints, accepted and ignored, and vLLM's aliases. An option
nobody defines is a ValueError naming it. This module imports nothing heavy, so that
`--help` answers at once.
"""

import argparse
import dataclasses
import difflib
import importlib
import json
import sys
from typing import get_args

from nanopaged.checks import check_fields

# name -> (type, default, what it does); the README's options table says the same
OPTIONS = {
    "model": (str, "Qwen/Qwen3-0.6B", "a checkpoint directory or a Hugging Face id"),
    "tokenizer": (
        str | None,
        None,
        "take the tokenizer from this directory or id instead",
    ),
    "tokenizer_mode": (
        str,
        "auto",
        "auto: the fast tokenizer (tokenizer.json), the only one nanopaged loads",
    ),
    "device": (str | None, None, "cuda or cpu (default: cuda if available)"),
    "dtype": (
        str | None,
        None,
        "auto (the checkpoint's on GPU, float32 on CPU), float32/float, "
        "float16/half, bfloat16",
    ),
    "max_num_batched_tokens": (
        int | None,
        None,
        "token budget of one step (default: 16384 on "
        "a GPU, 4096 on a CPU); longer prompts are "
        "prefilled in chunks",
    ),
    "max_num_seqs": (int, 512, "sequences running at once"),
    "max_model_len": (
        int | None,
        None,
        "longest prompt + completion (default: the model's)",
    ),
    "gpu_memory_utilization": (float, 0.9, "share of GPU memory the engine may use"),
    "kvcache_block_size": (
        int | None,
        None,
        "tokens per KV-cache block (default: 256 with flash-attn, else 16)",
    ),
    "num_kvcache_blocks": (
        int | None,
        None,
        "force the KV pool's size (default: sized from free memory)",
    ),
    "enforce_eager": (bool, False, "no CUDA graphs"),
    "attention_backend": (str, "auto", "auto, torch, triton or flash"),
    "scheduling": (
        str,
        "prefill-first",
        "prefill-first, or mixed: decode everyone each step, "
        "fill the rest with prompt chunks",
    ),
    "kv_cache_dtype": (
        str,
        "auto",
        "auto (the model's dtype), or fp8 / fp8_e4m3: K/V stored in "
        "e4m3, half a bfloat16 cache's bytes (not with flash-attn)",
    ),
    "enable_prefix_caching": (
        bool,
        True,
        "reuse the K/V of prompt prefixes seen before",
    ),
    "enable_chunked_prefill": (
        bool,
        True,
        "split prompts longer than the token budget over steps",
    ),
    "seed": (int, 0, "seed of the samples of requests that bring no seed of their own"),
    "tensor_parallel_size": (int, 1, "ranks, one process and one GPU each"),
    "distributed_port": (
        int | None,
        None,
        "where the ranks meet on 127.0.0.1 (default: a free port)",
    ),
    "distributed_executor_backend": (
        str | None,
        None,
        "mp (the engine starts its ranks) or "
        "external_launcher (the processes "
        "torchrun started, on any machines)",
    ),
    "data_parallel_size": (
        int,
        1,
        "replicas of the engine, each with its share of the requests",
    ),
    "generation_config": (
        str,
        "auto",
        "default sampling settings: auto (the checkpoint's), "
        "vllm (none), or a directory",
    ),
    "structured_outputs_config": (
        dict | None,
        None,
        'defaults of structured outputs, as JSON: {"disable_any_whitespace": true}',
    ),
    "speculative_config": (
        dict | None,
        None,
        'speculative decoding, as JSON: {"method": '
        '"ngram", "num_speculative_tokens": 4} or '
        '{"model": DRAFT, ...}',
    ),
    "enable_lora": (
        bool,
        False,
        "serve LoRA adapters: a request's lora_request (peft's "
        "format) adapts the model for it alone",
    ),
    "max_loras": (int, 1, "LoRA adapters in one step (their device slots)"),
    "max_lora_rank": (int, 16, "the highest rank of a LoRA adapter"),
    "max_cpu_loras": (
        int | None,
        None,
        "LoRA adapters kept read on the host (default: max_loras)",
    ),
    "runner": (
        str,
        "auto",
        "generate, pooling (embeddings, classes, scores), or auto: pooling for "
        "*Model and *ForSequenceClassification checkpoints and Sentence Transformers "
        "models",
    ),
    "task": (
        str | None,
        None,
        "vLLM's older --runner: generate, or embed, classify, score (pooling)",
    ),
    "pooler_config": (
        dict | None,
        None,
        'how a pooling engine pools, over the checkpoint\'s: {"pooling_type": '
        '"MEAN", "normalize": false} (LAST, MEAN, CLS, ALL)',
    ),
    "async_scheduling": (
        bool,
        False,
        "schedule and launch each step while the one before runs, and read that "
        "one's tokens then (vLLM's): the host's work hides behind the device's",
    ),
    "logprobs_mode": (
        str,
        "raw_logprobs",
        "what logprobs are of: raw_logprobs, the model's distribution; or "
        "processed_logprobs, the one sampled from (temperature, top-k, top-p, min-p: "
        "an RL trainer's)",
    ),
    "limit_mm_per_prompt": (
        dict | None,
        None,
        'images a prompt may hold, as JSON: {"image": 2} (default: 4)',
    ),
    "mm_processor_kwargs": (
        dict | None,
        None,
        'the image processor\'s options, as JSON: {"max_pixels": 802816}',
    ),
    "allowed_local_media_path": (
        str | None,
        None,
        "a directory whose image files (file:// URLs) prompts may name",
    ),
    "allow_remote_media": (
        bool,
        False,
        "fetch images given by http(s) URLs (off: such a URL is refused)",
    ),
    "enable_sleep_mode": (
        bool,
        False,
        "allow sleep(level) and wake_up(): give back the KV cache's memory, and the "
        "weights' (RL, between rounds of rollouts)",
    ),
    "weight_transfer_config": (
        dict | None,
        None,
        "vLLM's weight transfer from a trainer in another process, as JSON: "
        '{"backend": "nccl"} (NCCL on GPUs, gloo on CPUs) or {"backend": "gloo"}',
    ),
    "trace": (
        str | None,
        None,
        "write a trace of every step here (JSON lines); `python -m "
        "nanopaged.trace PATH` makes the page that plays it back",
    ),
    "config_format": (
        str,
        "auto",
        "auto or hf: the checkpoint's config.json (mistral's params.json is not read)",
    ),
    "load_format": (
        str,
        "auto",
        "auto or safetensors: the checkpoint's *.safetensors files "
        "(not .bin, gguf, ...)",
    ),
    "scheduling_policy": (
        str,
        "fcfs",
        "fcfs: requests in the order they came (vLLM's priority policy is not "
        "here; a request's priority must be 0)",
    ),
    # vLLM options that only tune what nanopaged does not have: checked, then ignored
    "trust_remote_code": (
        bool,
        False,
        "accepted: nanopaged runs no code from a checkpoint",
    ),
    "disable_log_stats": (bool, True, "accepted: nanopaged logs no periodic stats"),
    "swap_space": (
        float,
        4,
        "accepted: preempted sequences are recomputed, never swapped",
    ),
    # vLLM's older names
    "block_size": (int | None, None, "vLLM's name for --kvcache-block-size"),
    "guided_decoding_backend": (
        str | None,
        None,
        "vLLM's before 0.10: a backend (a hint), with "
        "':disable-any-whitespace' to ask for compact "
        "JSON",
    ),
}
HINTS = ("trust_remote_code", "disable_log_stats", "swap_space")
# vLLM's dtype names -> torch's ("auto": the checkpoint's on GPU, float32 on CPU)
DTYPES = {
    None: None,
    "auto": None,
    "half": "float16",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "float": "float32",
    "float32": "float32",
}
CHOICES = {
    "device": (None, "cuda", "cpu"),
    "dtype": tuple(DTYPES),
    "scheduling": ("prefill-first", "mixed"),
    "kv_cache_dtype": ("auto", "fp8", "fp8_e4m3"),
    "runner": ("auto", "generate", "pooling"),
    "task": (None, "auto", "generate", "embed", "classify", "score"),
    "logprobs_mode": ("raw_logprobs", "processed_logprobs"),
}
POSITIVE = (
    "max_num_batched_tokens",
    "max_num_seqs",
    "max_model_len",
    "kvcache_block_size",
    "num_kvcache_blocks",
)
# vLLM's options whose other values nanopaged does not do: what it does
FORMATS = {
    "config_format": ("auto", "hf"),
    "load_format": ("auto", "safetensors"),
    "scheduling_policy": ("fcfs",),
}
ALIASES = {"block_size": "kvcache_block_size"}
SURFACE = (
    "tokenizer",
    "tokenizer_mode",
    "generation_config",
    "structured_outputs_config",
    "speculative_config",
    "enable_lora",
    "max_loras",
    "max_lora_rank",
    "max_cpu_loras",
    "runner",
    "task",
    "pooler_config",
    "async_scheduling",
    "logprobs_mode",
    "limit_mm_per_prompt",
    "mm_processor_kwargs",
    "allowed_local_media_path",
    "allow_remote_media",
    "enable_sleep_mode",
    "weight_transfer_config",
    "trace",
)


def split_options(model: str, options: dict) -> tuple[dict, dict, dict]:
    """The options of `LLM(model, **options)`, checked by name, type and range, as the
    core's (for `make_config`), scaling out's (for `ParallelConfig`) and the surface's
    own."""
    from nanopaged.core.attention import BACKENDS  # torch: not before it is needed
    from nanopaged.core.config import Config
    from nanopaged.features import add_features
    from nanopaged.parallel.tensor import ParallelConfig

    add_features()  # the backends an option may name

    for name in set(options) - set(OPTIONS):
        close = difflib.get_close_matches(name, OPTIONS, n=1)
        raise ValueError(
            f"unknown option {name!r}"
            + (
                f"; did you mean {close[0]!r}?"
                if close
                else f"; the options are {', '.join(list(OPTIONS)[1:])}"
            )
        )
    if type(options.get("dtype")).__module__ == "torch":  # a torch.dtype: its name
        options = dict(options, dtype=str(options["dtype"]).removeprefix("torch."))
    transfer = options.get("weight_transfer_config")
    if hasattr(transfer, "backend"):  # vLLM's WeightTransferConfig: its dict
        options = dict(options, weight_transfer_config={"backend": transfer.backend})
    args = EngineArgs(model, **options)
    check_fields(args, dict(CHOICES, attention_backend=("auto", *BACKENDS)), POSITIVE)
    if not 0.0 < args.gpu_memory_utilization <= 1.0:
        raise ValueError(
            f"gpu_memory_utilization must be in (0, 1], "
            f"got {args.gpu_memory_utilization}"
        )
    options = _normalize(options)
    core, parallel = (
        {
            f.name: options[f.name]
            for f in dataclasses.fields(cls)
            if f.init and f.name in options
        }
        for cls in (Config, ParallelConfig)
    )
    return (
        core,
        parallel,
        {name: options.get(name, OPTIONS[name][1]) for name in SURFACE},
    )


def make_config(path: str, core: dict):
    """The core's `Config` of the checkpoint at `path` (read and checked) with the
    options `core` (checked by `split_options`), vLLM's names made torch's; a ValueError
    names what this machine or this checkpoint cannot do with them."""
    import torch

    from nanopaged.checkpoint import read_checkpoint_config
    from nanopaged.core.attention import BACKENDS
    from nanopaged.core.config import FLASH_BLOCK_SIZE, Config

    hf_config = read_checkpoint_config(path)
    check_max_model_len(core.get("max_model_len"), hf_config)
    if core.get("device") == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but torch sees no CUDA GPU")
    kv_dtype = core.get("kv_cache_dtype", "auto")
    config = Config(
        path,
        hf_config,
        **dict(
            core,
            dtype=DTYPES[core.get("dtype")] and getattr(torch, DTYPES[core["dtype"]]),
            kv_cache_dtype=None if kv_dtype == "auto" else torch.float8_e4m3fn,
        ),
    )
    check_batch_invariance(config.attention_backend)
    missing = BACKENDS[config.attention_backend].missing(
        config.device == "cuda", config.kv_cache_dtype
    )
    if missing is not None:
        raise ValueError(
            f"attention_backend={config.attention_backend!r} needs {missing}"
        )
    if (
        config.attention_backend == "flash"
        and config.kvcache_block_size % FLASH_BLOCK_SIZE
    ):
        raise ValueError(
            f"kvcache_block_size={config.kvcache_block_size} does not work with "
            f"flash-attn, whose paged KV needs a multiple of {FLASH_BLOCK_SIZE}; "
            f"use attention_backend='triton'"
        )
    if (
        not config.enable_chunked_prefill
        and config.max_num_batched_tokens < config.max_model_len
    ):
        raise ValueError(
            f"max_num_batched_tokens={config.max_num_batched_tokens} is smaller "
            f"than max_model_len={config.max_model_len}: without chunked prefill "
            f"longer prompts could never run; raise it or lower max_model_len"
        )
    return config


def check_max_model_len(max_model_len: int | None, hf_config) -> None:
    """As vLLM: a `max_model_len` beyond the model's positions is refused, unless
    $VLLM_ALLOW_LONG_MAX_MODEL_LEN is set, which stretches the model's positions to it
    (its rotary embedding then goes where it was not trained)."""
    from nanopaged import envs

    longest = hf_config.max_position_embeddings
    if max_model_len is None or max_model_len <= longest:
        return
    if not envs.VLLM_ALLOW_LONG_MAX_MODEL_LEN:
        raise ValueError(
            f"max_model_len={max_model_len} is more than the model's "
            f"{longest} positions (max_position_embeddings in its config.json): "
            f"leave it unset for {longest}, or lower it; to go past the model's "
            f"positions anyway, set VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 (its outputs "
            f"there may be nonsense)"
        )
    hf_config.max_position_embeddings = max_model_len


def check_batch_invariance(backend: str) -> None:
    """vLLM's $VLLM_BATCH_INVARIANT (read, never set) asks that a request's tokens and
    logprobs not depend on what runs beside it: the cpu backend's kernels are (always:
    docs/rl.md); the others' are not yet, and a run that asks for them is refused."""
    from nanopaged import envs

    if envs.VLLM_BATCH_INVARIANT and backend != "cpu":
        raise ValueError(
            f"VLLM_BATCH_INVARIANT=1 asks for batch-invariant kernels, and the "
            f"{backend!r} backend has none yet: nanopaged's are the cpu backend's "
            f"(attention_backend='cpu', on a CPU with a C compiler), always on"
        )


def _normalize(options: dict) -> dict:
    """`LLM(**options)` with vLLM's aliases renamed and its mere hints dropped."""
    for name, values in FORMATS.items():
        if options.get(name, values[0]) not in values:
            raise ValueError(
                f"{name}={options[name]!r} is not supported: nanopaged takes "
                f"{OPTIONS[name][2].partition(': ')[2]} ({' or '.join(values)})"
            )
    options = {
        name: value
        for name, value in options.items()
        if name not in HINTS and name not in FORMATS
    }
    backend = options.pop("guided_decoding_backend", None)  # vLLM's name before 0.10
    if backend is not None:
        name, _, extra = str(backend).partition(":")
        options["structured_outputs_config"] = dict(
            options.get("structured_outputs_config") or {},
            backend=name,
            disable_any_whitespace="disable-any-whitespace" in extra,
        )
    config = options.get("structured_outputs_config")
    if config is not None and (
        set(config) - {"backend", "disable_any_whitespace"}
        or not isinstance(config.get("disable_any_whitespace", False), bool)
    ):
        raise ValueError(
            f"structured_outputs_config takes backend and disable_any_whitespace "
            f"(true or false), got {config!r}"
        )
    for alias, name in ALIASES.items():
        if options.get(alias) is not None:
            if options.get(name) not in (None, options[alias]):
                raise ValueError(
                    f"{alias}={options[alias]} and {name}={options[name]} disagree"
                )
            options[name] = options[alias]
        options.pop(alias, None)
    return options


def _add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds a flag per engine option (--max-model-len, ...), each with its meaning and
    default."""
    for name, (kind, default, shown) in OPTIONS.items():
        kind = next(t for t in get_args(kind) or (kind,) if t is not type(None))
        flag = "--" + name.replace("_", "-")
        if kind is bool:
            parser.add_argument(
                flag,
                action=argparse.BooleanOptionalAction,
                default=default,
                help=f"{shown} (default: {default})",
            )
        else:
            parser.add_argument(
                flag,
                type=json.loads if kind is dict else kind,
                default=default,
                help=shown
                + (
                    f" (default: {default})"
                    if default is not None and "default" not in shown
                    else ""
                ),
            )
    return parser


def _from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
    return cls(**{name: getattr(args, name) for name in OPTIONS if hasattr(args, name)})


EngineArgs = dataclasses.make_dataclass(
    "EngineArgs",
    [
        (name, kind, dataclasses.field(default=default))
        for name, (kind, default, _) in OPTIONS.items()
    ],
    namespace={
        "__doc__": "vLLM's EngineArgs: every option of `LLM(model, **options)`, and "
        "its command-line flags. `LLM(**dataclasses.asdict(args))` takes them.",
        "add_cli_args": staticmethod(_add_cli_args),
        "from_cli_args": classmethod(_from_cli_args),
    },
)
EngineArgs.__module__ = __name__


class FlexibleArgumentParser(argparse.ArgumentParser):
    """vLLM's argument parser: `--max_model_len` means `--max-model-len`."""

    def parse_args(self, args=None, namespace=None):
        def dashed(arg: str) -> str:
            flag, equals, value = arg.partition("=")
            return (
                flag.replace("_", "-") + equals + value if arg.startswith("--") else arg
            )

        return super().parse_args(
            [dashed(a) for a in (sys.argv[1:] if args is None else args)], namespace
        )


def lacks(module: str, name: str, instead: str) -> ImportError | AttributeError:
    """The error for `from module import name` where vLLM has `name` and nanopaged has
    not: an ImportError saying what to use instead (an AttributeError for a dunder, as
    Python's)."""
    if name.startswith("__"):
        return AttributeError(name)
    return ImportError(
        f"cannot import {name!r} from {module}: vLLM has it there, nanopaged "
        f"does not. {instead}"
    )


def lazy_modules(package: str, submodules: tuple[str, ...], instead: str):
    """The `__getattr__` of one of vLLM's packages here: each of its `submodules`
    imported when first named (so that naming the package imports none of them), and
    `lacks` for any other name."""

    def getattr_(name: str):
        if name in submodules:
            return importlib.import_module(f"{package}.{name}")
        raise lacks(package, name, instead)

    return getattr_


def __getattr__(name: str):
    raise lacks(__name__, name, "nanopaged.engine.arg_utils has EngineArgs")
