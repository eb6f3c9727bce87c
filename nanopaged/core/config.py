"""The core's options: what `LLMEngineCore` needs to know, resolved for this machine and
this checkpoint. What a user gives is checked above the core before it gets here
(`nanopaged/engine/arg_utils.py`: names, types, ranges, what this machine can do)."""

from dataclasses import dataclass

import torch
from transformers import AutoConfig, PretrainedConfig

from nanopaged.core.attention import BACKENDS

FLASH_BLOCK_SIZE = 256  # flash-attn's paged KV needs pages of a multiple of 256 tokens


@dataclass
class Config:
    """The checkpoint directory `model` (its config `hf_config`, read from it when None)
    and the core's options. `None` means "choose for me": `device` cuda when available,
    `dtype` the checkpoint's on GPU and float32 on CPU, `max_model_len` the model's,
    `kvcache_block_size` 256 with flash-attn and 16 otherwise, `max_num_batched_tokens`
    16384 on a GPU and 4096 on a CPU (whose caches then hold a step), `kv_cache_dtype`
    the model's dtype; `attention_backend` "auto" picks the first usable of
    `attention.BACKENDS` for the device. `num_kvcache_blocks` forces the pool's size;
    `scheduling`: see `Scheduler`; `seed` seeds the samples of unseeded sequences."""

    model: str
    hf_config: PretrainedConfig | None = None
    device: str | None = None
    dtype: torch.dtype | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 512
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    kvcache_block_size: int | None = None
    num_kvcache_blocks: int | None = None
    enforce_eager: bool = False
    attention_backend: str = "auto"
    scheduling: str = "prefill-first"
    kv_cache_dtype: torch.dtype | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        self.hf_config = self.hf_config or AutoConfig.from_pretrained(self.model)
        longest = self.hf_config.max_position_embeddings
        self.max_model_len = min(self.max_model_len or longest, longest)
        self.device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = 16384 if self.device == "cuda" else 4096
        if self.dtype is None:
            checkpoint_dtype = getattr(self.hf_config, "dtype", None) or torch.float32
            self.dtype = checkpoint_dtype if self.device == "cuda" else torch.float32
        self.kv_cache_dtype = self.kv_cache_dtype or self.dtype
        if self.attention_backend == "auto":
            self.attention_backend = self.first_usable_backend()
        if self.kvcache_block_size is None:
            flash = self.attention_backend == "flash"
            self.kvcache_block_size = FLASH_BLOCK_SIZE if flash else 16

    def first_usable_backend(self) -> str:
        """The backend "auto" picks: the first of BACKENDS that runs on this device and
        lacks nothing here, plain "torch" last (it runs everywhere)."""
        on_gpu = self.device == "cuda"
        for name in [name for name in BACKENDS if name != "torch"] + ["torch"]:
            backend = BACKENDS[name]
            if self.device not in backend.auto_on:
                continue
            if backend.missing(on_gpu, self.kv_cache_dtype) is None:
                return name
