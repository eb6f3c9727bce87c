"""The decoder's building blocks, sharded over tensor-parallel ranks: a column-parallel linear
splits its output features, a row-parallel one its input features (then all-reduces its output).
Its `weight_loader(param, tensor, shard_id)` copies this rank's slice of a checkpoint tensor."""
import functools
import math
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


# Seam: a plain function of `fused` -> its kernel on a CPU, process-wide (the CPU backend's)
CPU_KERNELS: dict[Callable, Callable] = {}


def fused(fn):
    """`fn`, fused: by torch.compile (once used) on a GPU, where tiny kernels' launches are most
    of a small decode step's time; on a CPU by its kernel in CPU_KERNELS, else as written."""
    compiled = functools.cache(lambda: torch.compile(fn, dynamic=True))

    @functools.wraps(fn)
    def dispatch(x: torch.Tensor, *args):
        return (compiled() if x.is_cuda else CPU_KERNELS.get(fn, fn))(x, *args)
    return dispatch


def to_device(device: torch.device, values, dtype: torch.dtype | None = None):
    """Host values (None stays None) as a tensor on `device`; on a GPU from pinned memory: a copy
    from pageable memory would first wait for the queued kernels (the forward) to finish."""
    tensor = None if values is None else torch.as_tensor(values, dtype=dtype)
    if tensor is not None and device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor


def tp_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def tp_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def tp_shard(loaded: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    shard_size = loaded.shape[dim] // size
    return loaded.narrow(dim, rank * shard_size, shard_size)


def parameter(data: torch.Tensor, output_dim: int | None = None, input_dim: int | None = None,
              output_pack: int = 1, input_pack: int = 1) -> nn.Parameter:
    """A weight tensor that knows which of its dims hold the layer's output and input features
    (None: neither) and how many features one entry stands for along each (a 4-bit word packs
    8; a scale may cover a group of 128): all a weight loader needs to place q/k/v or gate/up
    parts and tensor-parallel shards of it."""
    param = nn.Parameter(data, requires_grad=False)
    param.output_dim = output_dim
    param.input_dim = input_dim
    param.output_pack = output_pack
    param.input_pack = input_pack
    return param


class LinearMethod:
    """How a linear layer keeps and multiplies its weight: here a float (out, in) weight and
    `F.linear`. The seam of a backend's own kernels (nanopaged/cpu.py) and of quantized formats,
    which nanopaged/quantization/ enters in `QUANTIZATIONS[quant_method](quantization_config,
    float method)`: `create_weights(layer, in_features, out_features)` registers the layer's
    parameters (see `parameter`), `process_weights(layer)` runs once the checkpoint is loaded
    (to repack or dequantize them), `apply(layer, x)` multiplies (LoRA adds its delta)."""

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int) -> None:
        layer.weight = parameter(torch.empty(out_features, in_features), 0, 1)

    def process_weights(self, layer: nn.Module) -> None:
        pass

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)


QUANTIZATIONS: dict[str, Callable[[dict, LinearMethod], LinearMethod]] = {}

# The methods of the layers being built: the projections' (q/k/v, o, gate/up, down) and the
# others' (LM head, routers). `load_model` sets them for the model it builds (see
# `linear_methods`), as it sets torch's default dtype and device.
_building = [LinearMethod(), LinearMethod()]


@contextmanager
def linear_methods(projections: LinearMethod, others: LinearMethod) -> Iterator[None]:
    """Layers built inside the block take these methods."""
    saved = list(_building)
    _building[:] = projections, others
    try:
        yield
    finally:
        _building[:] = saved


class LinearBase(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, projection: bool = False):
        super().__init__()
        self.tp_rank = tp_rank()
        self.tp_size = tp_size()
        self.in_features = in_features  # this rank's, whatever format the method keeps
        self.out_features = out_features
        self.method = _building[0] if projection else _building[1]
        self.method.create_weights(self, in_features, out_features)
        self.bias = parameter(torch.empty(out_features), 0) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)


def load_output_shard(layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor,
                      offset: int = 0, size: int | None = None) -> None:
    """Copies this rank's slice of the checkpoint tensor `loaded` (tensor-parallel ranks split
    its output features) into the output features [offset, offset + size) of `param` (all of it
    if it has no output dim); a scalar (a part's scale) fills the part."""
    dim, pack = param.output_dim, param.output_pack
    if dim is None:
        return param.data.copy_(loaded)
    size = param.shape[dim] * pack if size is None else size
    if offset % pack or size % pack:
        raise ValueError(f"a part of {size} features at {offset} splits the groups of {pack}")
    if loaded.dim():
        loaded = tp_shard(loaded, dim, layer.tp_rank, layer.tp_size)
    param.data.narrow(dim, offset // pack, size // pack).copy_(loaded)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; no communication."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__(in_features, out_features // tp_size(), bias, projection=True)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        load_output_shard(self, param, loaded)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel linears stored as one (gate and up projections): one matmul."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        load_output_shard(self, param, loaded, offset, self.output_sizes[shard_id] // self.tp_size)


class QKVParallelLinear(ColumnParallelLinear):
    """The q, k and v projections as one linear; each rank holds its own heads of all three."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False):
        self.head_dim = head_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        super().__init__(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        q_size = self.num_heads * self.head_dim // self.tp_size
        kv_size = self.num_kv_heads * self.head_dim // self.tp_size
        offset = {"q": 0, "k": q_size, "v": q_size + kv_size}[shard_id]
        load_output_shard(self, param, loaded, offset, q_size if shard_id == "q" else kv_size)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs are summed with an all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__(in_features // tp_size(), out_features, bias, projection=True)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if param is self.bias:  # added once, on rank 0 only
            param.data.copy_(loaded if self.tp_rank == 0 else torch.zeros_like(loaded))
        elif param.input_dim is None:  # the same on every rank
            param.data.copy_(loaded)
        else:
            param.data.copy_(tp_shard(loaded, param.input_dim, self.tp_rank, self.tp_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.method.apply(self, x)
        if self.tp_size > 1:
            dist.all_reduce(y)
        return y


class VocabParallelEmbedding(nn.Module):
    """Each rank holds a contiguous slice of the vocabulary; an all-reduce assembles the rows."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.tp_rank = tp_rank()
        self.tp_size = tp_size()
        self.vocab_per_rank = vocab_size // self.tp_size
        self.vocab_start = self.tp_rank * self.vocab_per_rank
        self.weight = parameter(torch.empty(self.vocab_per_rank, hidden_size), 0, 1)

    weight_loader = ColumnParallelLinear.weight_loader

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local_ids = input_ids - self.vocab_start
        on_this_rank = (local_ids >= 0) & (local_ids < self.vocab_per_rank)
        y = F.embedding(local_ids.clamp(0, self.vocab_per_rank - 1), self.weight)
        y = y * on_this_rank.unsqueeze(-1).to(y.dtype)
        dist.all_reduce(y)
        return y


class ParallelLMHead(VocabParallelEmbedding):
    """Projects hidden states to logits over the whole vocabulary, gathered on every rank."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__(vocab_size, hidden_size)
        self.bias = None
        self.method = _building[1]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.method.apply(self, hidden)
        if self.tp_size == 1:
            return logits
        shards = [torch.empty_like(logits) for _ in range(self.tp_size)]
        dist.all_gather(shards, logits)
        return torch.cat(shards, dim=-1)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # normalise in float32 as transformers does, then scale in the model's dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


rms_norm = fused(_rms_norm)


@fused
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(norm(x + residual), x + residual): the residual add fused with the next norm."""
    x = x + residual
    return _rms_norm(x, weight, eps), x


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)


@fused
def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# (head_dim, max_position, parameters, device) -> cos and sin of every position, side by side
_ROPE_TABLES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


class RotaryEmbedding(nn.Module):
    """Rotary position embedding in the rotate-half layout of Qwen and Llama checkpoints. The
    layers with the same parameters share one table (a long context's is hundreds of MB)."""

    def __init__(self, head_dim: int, max_position: int, rope_parameters: dict):
        super().__init__()
        key = (head_dim, max_position, str(sorted(rope_parameters.items())),
               str(torch.get_default_device()))
        table = _ROPE_TABLES.get(key)
        if table is None:
            inv_freq = 1.0 / (rope_parameters["rope_theta"]
                              ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
            if rope_parameters.get("rope_type") == "llama3":  # other types: see check_supported
                inv_freq = _llama3_inv_freq(inv_freq, rope_parameters)
            if rope_parameters.get("rope_type") == "linear":  # positions divided by the factor
                inv_freq = inv_freq / rope_parameters["factor"]
            freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
            table = _ROPE_TABLES[key] = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
        self.register_buffer("cos_sin", table, persistent=False)  # (max_position, head_dim)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        return apply_rotary(q, k, positions, self.cos_sin)


@fused
def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor):
    # q: (T, nh, hs), k: (T, nkv, hs); cos, sin: (T, 1, hs/2) in the model's dtype, as transformers
    cos, sin = cos_sin[positions].unsqueeze(1).to(q.dtype).chunk(2, dim=-1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    """Llama 3's frequency scaling: long wavelengths slowed by `factor`, short ones kept,
    the band between blended smoothly."""
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, blended, scaled)
