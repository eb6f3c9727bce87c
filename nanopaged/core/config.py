"""The core's options: what `LLMEngine` needs to know, each checked once. A feature's options are
its own dataclass, in its own file (see `nanopaged/engine_args.py` for all of them)."""
import os
from dataclasses import dataclass, field, fields
from typing import get_args

import torch
from transformers import AutoConfig, PretrainedConfig

from nanopaged.core.attention import BACKENDS
from nanopaged.core.model import check_supported

# vLLM's dtype names, and what each means here ("auto": the checkpoint's on GPU)
DTYPES = {None: None, "auto": None, "half": "float16", "float16": "float16",
          "bfloat16": "bfloat16", "float": "float32", "float32": "float32"}
CHOICES = {"device": (None, "cuda", "cpu"), "dtype": tuple(DTYPES),
           "scheduling": ("prefill-first", "mixed"), "kv_cache_dtype": ("auto", "fp8", "fp8_e4m3")}
POSITIVE = ("max_num_batched_tokens", "max_num_seqs", "max_model_len", "kvcache_block_size",
            "num_kvcache_blocks")
FLASH_BLOCK_SIZE_MULTIPLE = 256  # flash-attn's paged KV needs pages of a multiple of 256 tokens


def check_fields(options, choices: dict[str, tuple] = {}, positive: tuple[str, ...] = ()) -> None:
    """A ValueError naming the first field of the dataclass `options` whose value has not the
    field's type, is not one of its `choices`, or is below 1 while it should be `positive`."""
    for f in filter(lambda f: f.init, fields(options)):
        value = getattr(options, f.name)
        allowed = get_args(f.type) or (f.type,)
        numbers = allowed + ((int,) if float in allowed else ())  # an int is a number too
        if (isinstance(value, bool) and bool not in allowed) or not isinstance(value, numbers):
            names = " or ".join("None" if t is type(None) else "a number" if t is float
                                else t.__name__ for t in allowed)
            raise ValueError(f"{f.name} must be {names}, got {value!r}")
        if f.name in positive and value is not None and value < 1:
            raise ValueError(f"{f.name} must be >= 1, got {value}")
    for name, named in choices.items():
        value = getattr(options, name)
        value = str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else value
        if value not in named:
            raise ValueError(f"{name} must be one of {tuple(c for c in named if c)}, got {value!r}")


@dataclass
class Config:
    """The checkpoint directory `model` and the core's options. `None` means "choose for me":
    `device` cuda when available, `dtype` the checkpoint's on GPU and float32 on CPU,
    `max_model_len` the model's, `kvcache_block_size` 256 with flash-attn and 16 otherwise;
    `max_num_batched_tokens` 16384 on a GPU, 4096 on a CPU (whose caches then hold a step);
    `attention_backend` "auto" picks the first usable of `attention.BACKENDS` for the device.
    `num_kvcache_blocks` forces the pool's size; `scheduling`: see `Scheduler`; `seed` seeds
    the samples of sequences with no seed of their own. `kv_cache_dtype="fp8"`: K/V in e4m3."""
    model: str
    device: str | None = None
    dtype: str | torch.dtype | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 512
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    kvcache_block_size: int | None = None
    num_kvcache_blocks: int | None = None
    enforce_eager: bool = False
    attention_backend: str = "auto"
    scheduling: str = "prefill-first"
    kv_cache_dtype: str | torch.dtype = "auto"
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    seed: int = 0
    hf_config: PretrainedConfig = field(init=False)

    def __post_init__(self) -> None:
        check_fields(self, CHOICES, POSITIVE)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], "
                             f"got {self.gpu_memory_utilization}")
        self.hf_config = read_checkpoint_config(self.model)
        longest = self.hf_config.max_position_embeddings
        self.max_model_len = min(self.max_model_len or longest, longest)
        self._resolve_device_and_dtype()
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = 16384 if self.device == "cuda" else 4096
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} is smaller "
                             f"than max_model_len={self.max_model_len}: without chunked prefill "
                             f"longer prompts could never run; raise it or lower max_model_len")
        self._resolve_attention_backend()

    def _resolve_device_and_dtype(self) -> None:
        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' was asked for but torch sees no CUDA GPU")
        if isinstance(self.dtype, str):
            self.dtype = DTYPES[self.dtype] and getattr(torch, DTYPES[self.dtype])
        if self.dtype is None:
            checkpoint_dtype = getattr(self.hf_config, "dtype", None) or torch.float32
            self.dtype = checkpoint_dtype if self.device == "cuda" else torch.float32
        self.kv_cache_dtype = self.dtype if self.kv_cache_dtype == "auto" else torch.float8_e4m3fn

    def _resolve_attention_backend(self) -> None:
        on_gpu = self.device == "cuda"
        if self.attention_backend == "auto":  # the first usable for the device, plain torch last
            self.attention_backend = next(
                name for name in sorted(BACKENDS, key=lambda name: name == "torch")
                if self.device in BACKENDS[name].auto_on
                and BACKENDS[name].missing(on_gpu, self.kv_cache_dtype) is None)
        if self.attention_backend not in BACKENDS:
            raise ValueError(f"attention_backend must be one of {('auto', *BACKENDS)}, "
                             f"got {self.attention_backend!r}")
        missing = BACKENDS[self.attention_backend].missing(on_gpu, self.kv_cache_dtype)
        if missing is not None:
            raise ValueError(f"attention_backend={self.attention_backend!r} needs {missing}")
        flash = self.attention_backend == "flash"
        if self.kvcache_block_size is None:
            self.kvcache_block_size = FLASH_BLOCK_SIZE_MULTIPLE if flash else 16
        if flash and self.kvcache_block_size % FLASH_BLOCK_SIZE_MULTIPLE:
            raise ValueError(f"kvcache_block_size={self.kvcache_block_size} does not work with "
                             f"flash-attn, whose paged KV needs a multiple of "
                             f"{FLASH_BLOCK_SIZE_MULTIPLE}; use attention_backend='triton'")


def read_checkpoint_config(path: str) -> PretrainedConfig:
    """The checkpoint's config, once its architecture and fields are known to be supported."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"{path!r} has no config.json: it is not a Hugging Face checkpoint")
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as error:
        raise ValueError(f"cannot read {os.path.join(path, 'config.json')}: {error}") from None
    check_supported(config)
    return config
