"""Engine configuration: every knob of `LLM(model, **kwargs)`, validated once."""
import difflib
import os
import socket
from dataclasses import dataclass, field, fields
from typing import get_args

import torch
from transformers import AutoConfig, GenerationConfig, PretrainedConfig

from nanopaged.model import check_supported

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM")
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flash")
SCHEDULING_POLICIES = ("prefill-first", "mixed")
# What the engine reads of a Hugging Face repository: configs, tokenizer files, weights.
MODEL_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken"]
FLASH_BLOCK_SIZE_MULTIPLE = 256  # flash-attn's paged KV needs pages of a multiple of 256 tokens


def flash_attn_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def triton_interpreted() -> bool:
    """Triton's interpreter runs kernels on CPU tensors: slow, but it lets CI test them."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def resolve_model(model: str) -> str:
    """The local directory of `model`: the directory itself, or a Hugging Face id found in the
    local cache or else downloaded (only the files the engine reads)."""
    if os.path.isdir(model):
        return model
    from huggingface_hub import snapshot_download
    try:
        return snapshot_download(model, local_files_only=True)
    except Exception:
        pass
    try:
        return snapshot_download(model, allow_patterns=MODEL_FILES)
    except Exception as error:
        raise ValueError(
            f"model {model!r} is not a local directory, and as a Hugging Face id it is neither in "
            f"the cache nor downloadable ({type(error).__name__}); download it where there is "
            f"network (`hf download {model}`) and copy the cache here, or pass the directory of "
            f"a checkpoint") from None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Config:
    """Everything the engine needs to know, resolved from `LLM(model, **kwargs)`.

    `model` is a checkpoint directory or a Hugging Face id (see `resolve_model`).
    `None` means "choose for me": `device` picks cuda when available, `dtype` the checkpoint's
    dtype on GPU and float32 on CPU, `attention_backend` "auto" picks flash-attn, then Triton
    (both CUDA only), then plain PyTorch, and `kvcache_block_size` 256 with flash-attn and 16
    otherwise. `num_kvcache_blocks` forces the size of the KV pool instead of sizing it from
    free memory. `tensor_parallel_size` ranks meet on `distributed_port` of 127.0.0.1 (a free
    port when None). `scheduling` is "prefill-first" or "mixed" (see `Scheduler`).
    """
    model: str
    device: str | None = None
    dtype: str | torch.dtype | None = None
    max_num_batched_tokens: int = 16384
    max_num_seqs: int = 512
    max_model_len: int = 4096
    gpu_memory_utilization: float = 0.9
    kvcache_block_size: int | None = None
    num_kvcache_blocks: int | None = None
    enforce_eager: bool = False
    tensor_parallel_size: int = 1
    distributed_port: int | None = None
    attention_backend: str = "auto"
    scheduling: str = "prefill-first"
    hf_config: PretrainedConfig = field(init=False)
    eos_token_ids: frozenset[int] = field(init=False)

    @classmethod
    def from_options(cls, model: str, **options) -> "Config":
        """`Config(model, **options)`, with unknown option names a ValueError naming them."""
        names = [f.name for f in fields(cls) if f.init]
        for name in options:
            if name not in names:
                close = difflib.get_close_matches(name, names, n=1)
                raise ValueError(f"unknown option {name!r}" + (f"; did you mean {close[0]!r}?" if close
                                 else f"; the options are {', '.join(names[1:])}"))
        return cls(model, **options)

    def __post_init__(self) -> None:
        self._check_types()
        self.model = resolve_model(self.model)
        self.hf_config = _read_checkpoint_config(self.model)
        architectures = getattr(self.hf_config, "architectures", None) or []
        if not any(a in SUPPORTED_ARCHITECTURES for a in architectures):
            raise ValueError(f"unsupported architecture {architectures}; nanopaged supports "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        check_supported(self.hf_config)
        self.eos_token_ids = _eos_token_ids(self.model, self.hf_config)
        if self.scheduling not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling must be one of {SCHEDULING_POLICIES}, got {self.scheduling!r}")
        self._resolve_device_and_dtype()
        self._resolve_attention_backend()
        self._validate_sizes()
        self._validate_tensor_parallel()

    def _check_types(self) -> None:
        for f in filter(lambda f: f.init, fields(self)):
            value, allowed = getattr(self, f.name), get_args(f.type) or (f.type,)
            if isinstance(value, int) and float in allowed and not isinstance(value, bool):
                continue
            if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
                names = " or ".join("None" if t is type(None) else t.__name__ for t in allowed)
                raise ValueError(f"{f.name} must be {names}, got {value!r}")

    def _resolve_device_and_dtype(self) -> None:
        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"device must be 'cuda' or 'cpu', got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' was asked for but torch sees no CUDA GPU")
        if self.dtype is None:
            checkpoint_dtype = getattr(self.hf_config, "dtype", None) or torch.float32
            self.dtype = checkpoint_dtype if self.device == "cuda" else torch.float32
        if isinstance(self.dtype, str):
            if self.dtype not in ("float32", "float16", "bfloat16"):
                raise ValueError(f"dtype must be float32, float16 or bfloat16, got {self.dtype!r}")
            self.dtype = getattr(torch, self.dtype)
        if self.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"dtype must be float32, float16 or bfloat16, got {self.dtype}")

    def _resolve_attention_backend(self) -> None:
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                             f"got {self.attention_backend!r}")
        on_gpu = self.device == "cuda"
        if self.attention_backend == "auto":
            if on_gpu and self.dtype != torch.float32 and flash_attn_available():
                self.attention_backend = "flash"
            elif on_gpu and triton_available():
                self.attention_backend = "triton"
            else:
                self.attention_backend = "torch"
        elif self.attention_backend == "triton" and not on_gpu and not triton_interpreted():
            raise ValueError("attention_backend='triton' needs a CUDA GPU (or TRITON_INTERPRET=1)")
        elif self.attention_backend == "flash" and not on_gpu:
            raise ValueError("attention_backend='flash' needs a CUDA GPU")
        elif self.attention_backend == "flash" and not flash_attn_available():
            raise ValueError("attention_backend='flash' but flash_attn is not importable")
        elif self.attention_backend == "flash" and self.dtype == torch.float32:
            raise ValueError("attention_backend='flash' needs dtype float16 or bfloat16")
        elif self.attention_backend == "triton" and not triton_available():
            raise ValueError("attention_backend='triton' but triton is not importable")

    def _validate_sizes(self) -> None:
        if self.kvcache_block_size is None:
            self.kvcache_block_size = 256 if self.attention_backend == "flash" else 16
        if self.kvcache_block_size < 1:
            raise ValueError(f"kvcache_block_size must be >= 1, got {self.kvcache_block_size}")
        if (self.attention_backend == "flash"
                and self.kvcache_block_size % FLASH_BLOCK_SIZE_MULTIPLE != 0):
            raise ValueError(f"kvcache_block_size={self.kvcache_block_size} does not work with "
                             f"flash-attn, whose paged KV needs a multiple of "
                             f"{FLASH_BLOCK_SIZE_MULTIPLE}; use attention_backend='triton'")
        for field in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be >= 1, got {getattr(self, field)}")
        self.max_model_len = min(self.max_model_len, self.hf_config.max_position_embeddings)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], "
                             f"got {self.gpu_memory_utilization}")
        if self.num_kvcache_blocks is not None and self.num_kvcache_blocks < 1:
            raise ValueError(f"num_kvcache_blocks must be >= 1, got {self.num_kvcache_blocks}")

    def _validate_tensor_parallel(self) -> None:
        size = self.tensor_parallel_size
        if size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
        if self.device == "cuda" and size > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size={size} but only {torch.cuda.device_count()} "
                             f"CUDA GPU(s) are visible")
        for field in ("num_attention_heads", "num_key_value_heads", "vocab_size",
                      "intermediate_size"):
            value = getattr(self.hf_config, field)
            if value % size:
                raise ValueError(f"the model's {field}={value} is not divisible by "
                                 f"tensor_parallel_size={size}")
        if size > 1 and self.distributed_port is None:
            self.distributed_port = free_port()
        if self.distributed_port is not None and not 0 < self.distributed_port < 65536:
            raise ValueError(f"distributed_port must be in [1, 65535], got {self.distributed_port}")


def _read_checkpoint_config(path: str) -> PretrainedConfig:
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"{path!r} has no config.json: it is not a Hugging Face checkpoint")
    try:
        return AutoConfig.from_pretrained(path)
    except Exception as error:
        raise ValueError(f"cannot read {os.path.join(path, 'config.json')}: {error}") from None


def _eos_token_ids(path: str, hf_config: PretrainedConfig) -> frozenset[int]:
    """The generation config's EOS ids, else the model config's."""
    eos = None
    if os.path.exists(os.path.join(path, "generation_config.json")):
        eos = GenerationConfig.from_pretrained(path).eos_token_id
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None)
    return frozenset([] if eos is None else eos if isinstance(eos, list) else [eos])
