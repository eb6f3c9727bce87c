"""Engine configuration: every knob of `LLM(model, **kwargs)`, validated once."""
import difflib
import importlib.util
import os
import socket
from dataclasses import dataclass, field, fields
from typing import get_args

import torch
from transformers import AutoConfig, PretrainedConfig

from nanopaged.model import check_supported
from nanopaged.speculative import SpeculativeConfig

# vLLM's dtype names, and what each means here ("auto": the checkpoint's on GPU)
DTYPES = {None: None, "auto": None, "half": "float16", "float16": "float16",
          "bfloat16": "bfloat16", "float": "float32", "float32": "float32"}
CHOICES = {"device": (None, "cuda", "cpu"), "dtype": tuple(DTYPES),
           "attention_backend": ("auto", "torch", "triton", "flash"),
           "scheduling": ("prefill-first", "mixed"),
           "distributed_executor_backend": (None, "mp", "external_launcher")}
POSITIVE = ("max_num_batched_tokens", "max_num_seqs", "max_model_len", "kvcache_block_size",
            "num_kvcache_blocks", "tensor_parallel_size", "data_parallel_size")
TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# What the engine reads of a Hugging Face repository: configs, tokenizer files, weights.
MODEL_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken"]
FLASH_BLOCK_SIZE_MULTIPLE = 256  # flash-attn's paged KV needs pages of a multiple of 256 tokens


def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


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

    `model` is a checkpoint directory or a Hugging Face id (see `resolve_model`), `tokenizer`
    another one to take the tokenizer from. `None` means "choose for me": `device` picks cuda
    when available, `dtype` the checkpoint's dtype on GPU and float32 on CPU, `max_model_len`
    the model's, `attention_backend` "auto" picks flash-attn, then Triton (both CUDA only),
    then plain PyTorch, and `kvcache_block_size` 256 with flash-attn and 16 otherwise.
    `num_kvcache_blocks` forces the size of the KV pool instead of sizing it from free memory.
    `tensor_parallel_size` ranks are processes the engine starts, meeting on `distributed_port`
    of 127.0.0.1 (a free port when None); with `distributed_executor_backend`
    "external_launcher" they are the processes torchrun started, on any machines (see
    `parallel.py`). `data_parallel_size` replicas of the engine each serve a share of the
    requests (see `data_parallel.py`). `scheduling` is "prefill-first" or "mixed" (see
    `Scheduler`); without `enable_chunked_prefill` a prompt is never split over steps. `seed`
    seeds the samples of requests that bring no seed of their own. `generation_config` is where
    default sampling settings come from: "auto" (the checkpoint's generation_config.json),
    "vllm" (none), or a directory. `structured_outputs_config` holds vLLM's defaults for
    structured outputs (`backend`, `disable_any_whitespace`). `speculative_config` turns
    speculative decoding on (see `SpeculativeConfig`).
    """
    model: str
    tokenizer: str | None = None
    device: str | None = None
    dtype: str | torch.dtype | None = None
    max_num_batched_tokens: int = 16384
    max_num_seqs: int = 512
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    kvcache_block_size: int | None = None
    num_kvcache_blocks: int | None = None
    enforce_eager: bool = False
    tensor_parallel_size: int = 1
    distributed_port: int | None = None
    distributed_executor_backend: str | None = None
    data_parallel_size: int = 1
    attention_backend: str = "auto"
    scheduling: str = "prefill-first"
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    seed: int = 0
    generation_config: str = "auto"
    structured_outputs_config: dict | None = None
    speculative_config: dict | None = None
    hf_config: PretrainedConfig = field(init=False)
    speculative: SpeculativeConfig | None = field(init=False, default=None)

    @classmethod
    def from_options(cls, model: str, **options) -> "Config":
        """`Config(model, **options)`, with unknown option names a ValueError naming them."""
        names = [f.name for f in fields(cls) if f.init]
        for name in set(options) - set(names):
            close = difflib.get_close_matches(name, names, n=1)
            raise ValueError(f"unknown option {name!r}" + (f"; did you mean {close[0]!r}?" if close
                             else f"; the options are {', '.join(names[1:])}"))
        return cls(model, **options)

    def __post_init__(self) -> None:
        self._check_values()
        self.model = resolve_model(self.model)
        self.tokenizer = resolve_model(self.tokenizer) if self.tokenizer else self.model
        self.hf_config = _read_checkpoint_config(self.model)
        check_supported(self.hf_config)
        longest = self.hf_config.max_position_embeddings
        self.max_model_len = min(self.max_model_len or longest, longest)
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} is smaller "
                             f"than max_model_len={self.max_model_len}: without chunked prefill "
                             f"longer prompts could never run; raise it or lower max_model_len")
        self._resolve_device_and_dtype()
        self._resolve_attention_backend()
        self._check_tensor_parallel()
        if self.speculative_config is not None:
            self.speculative = SpeculativeConfig.from_dict(self.speculative_config, self)

    def _check_values(self) -> None:
        """Each option's type, range or choices, before anything is loaded."""
        for f in filter(lambda f: f.init, fields(self)):
            value, allowed = getattr(self, f.name), get_args(f.type) or (f.type,)
            if isinstance(value, bool) and bool not in allowed or not isinstance(
                    value, allowed + ((int,) if float in allowed else ())):
                names = " or ".join("None" if t is type(None) else t.__name__ for t in allowed)
                raise ValueError(f"{f.name} must be {names}, got {value!r}")
        for name in POSITIVE:
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name, choices in CHOICES.items():
            value = getattr(self, name)
            if name == "dtype" and value is not None:
                value = str(value).removeprefix("torch.")
            if value not in choices:
                named = choices[1:] if None in choices else choices
                raise ValueError(f"{name} must be one of {named}, got {value!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], "
                             f"got {self.gpu_memory_utilization}")
        if self.distributed_port is not None and not 0 < self.distributed_port < 65536:
            raise ValueError(f"distributed_port must be in [1, 65535], "
                             f"got {self.distributed_port}")

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

    def _resolve_attention_backend(self) -> None:
        on_gpu = self.device == "cuda"
        half = self.dtype != torch.float32
        if self.attention_backend == "auto":
            self.attention_backend = ("flash" if on_gpu and half and flash_attn_available()
                                      else "triton" if on_gpu and triton_available() else "torch")
        needs = {"triton": [(on_gpu or triton_interpreted(), "a CUDA GPU (or TRITON_INTERPRET=1)"),
                            (triton_available(), "triton to be importable")],
                 "flash": [(on_gpu, "a CUDA GPU"),
                           (flash_attn_available(), "flash_attn to be importable"),
                           (half, "dtype float16 or bfloat16")]}
        for met, what in needs.get(self.attention_backend, []):
            if not met:
                raise ValueError(f"attention_backend={self.attention_backend!r} needs {what}")
        if self.kvcache_block_size is None:
            self.kvcache_block_size = 256 if self.attention_backend == "flash" else 16
        flash = self.attention_backend == "flash"
        if flash and self.kvcache_block_size % FLASH_BLOCK_SIZE_MULTIPLE:
            raise ValueError(f"kvcache_block_size={self.kvcache_block_size} does not work with "
                             f"flash-attn, whose paged KV needs a multiple of "
                             f"{FLASH_BLOCK_SIZE_MULTIPLE}; use attention_backend='triton'")

    def _check_tensor_parallel(self) -> None:
        size = self.tensor_parallel_size
        for name in ("num_attention_heads", "num_key_value_heads", "vocab_size",
                     "intermediate_size"):
            if getattr(self.hf_config, name) % size:
                raise ValueError(f"the model's {name}={getattr(self.hf_config, name)} is not "
                                 f"divisible by tensor_parallel_size={size}")
        if self.external_launcher:
            self._check_torchrun()
            return
        gpus = size * self.data_parallel_size
        if self.device == "cuda" and gpus > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size={size} x data_parallel_size="
                             f"{self.data_parallel_size} needs {gpus} GPUs but only "
                             f"{torch.cuda.device_count()} CUDA GPU(s) are visible")
        if size > 1 and self.distributed_port is None:
            self.distributed_port = free_port()

    def _check_torchrun(self) -> None:
        missing = [name for name in TORCHRUN_VARIABLES if name not in os.environ]
        if missing:
            raise ValueError(f"distributed_executor_backend='external_launcher' runs under "
                             f"torchrun, which sets {', '.join(missing)}: launch the script "
                             f"with torchrun --nproc-per-node N [--nnodes M ...]")
        world_size = int(os.environ["WORLD_SIZE"])
        if world_size != self.tensor_parallel_size or self.data_parallel_size != 1:
            raise ValueError(f"torchrun started {world_size} processes; with "
                             f"distributed_executor_backend='external_launcher' they are the "
                             f"tensor_parallel_size={self.tensor_parallel_size} ranks of one "
                             f"engine (data_parallel_size must be 1: one torchrun job a replica)")
        if self.device == "cuda" and int(os.environ["LOCAL_RANK"]) >= torch.cuda.device_count():
            raise ValueError(f"LOCAL_RANK={os.environ['LOCAL_RANK']} but only "
                             f"{torch.cuda.device_count()} CUDA GPU(s) are visible on this node")

    @property
    def external_launcher(self) -> bool:
        return self.distributed_executor_backend == "external_launcher"


def _read_checkpoint_config(path: str) -> PretrainedConfig:
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"{path!r} has no config.json: it is not a Hugging Face checkpoint")
    try:
        return AutoConfig.from_pretrained(path)
    except Exception as error:
        raise ValueError(f"cannot read {os.path.join(path, 'config.json')}: {error}") from None
