"""The decoder's building blocks, sharded over tensor-parallel ranks: a column-parallel
linear splits its output features, a row-parallel one its input features (then
all-reduces its output). Its `weight_loader(param, tensor, shard_id)` copies this rank's
slice of a checkpoint tensor. What a layer computes with is one engine's choice, handed
to it as `Kernels` when it is built: nothing here is chosen for the whole process."""

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def compiled_on_gpu(fn: Callable, rows: int = 1) -> Callable:
    """`fn`, compiled by torch.compile (on first use) off the CPU, where launches are
    most of a small decode step; as written on it. Its kernels vary in one size, the
    step's tokens (the first of its first `rows` arguments); the model's are fixed."""
    compiled = functools.cache(lambda: torch.compile(fn, dynamic=False))

    @functools.wraps(fn)
    def dispatch(*args):
        if args[0].device.type == "cpu":
            return fn(*args)
        for x in args[:rows]:
            torch._dynamo.maybe_mark_dynamic(x, 0)
        return compiled()(*args)

    return dispatch


def to_device(device: torch.device, values, dtype: torch.dtype | None = None):
    """Host values (None stays None) as a tensor on `device`; on a GPU from pinned
    memory: a copy from pageable memory would wait for the queued kernels to finish."""
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


def parameter(
    data: torch.Tensor,
    output_dim=None,
    input_dim=None,
    output_pack=1,
    input_pack=1,
    checks=(),
):
    """A weight tensor that knows which of its dims hold the layer's output and input
    features (None: neither) and how many features one entry stands for along each (a
    4-bit word packs 8; a scale may cover a group of 128): all a weight loader needs to
    place q/k/v or gate/up parts and tensor-parallel shards of it. The loader runs its
    `checks` (a format's own) on each checkpoint tensor: each names a fault, or None."""
    param = nn.Parameter(data, requires_grad=False)
    param.output_dim = output_dim
    param.input_dim = input_dim
    param.output_pack = output_pack
    param.input_pack = input_pack
    param.checks = checks
    return param


class LinearMethod:
    """How a linear layer keeps and multiplies its weight: here a float (out, in) weight
    and `F.linear`. The seam of a backend's kernels (the CPU's) and of quantized formats
    (nanopaged/quantization/): `create_weights(layer, in_features, out_features)`
    registers the layer's parameters (see `parameter`); `process_weights(layer)`, once
    the checkpoint is loaded, may repack or dequantize them and returns the method that
    multiplies from then on (the loader sets the layer's `method`); `apply` does it. A
    method that repacks the weight defines `dense_weight(layer)` (the plain weight) and
    `set_dense_weight(layer, weight)` (packs a new one in place), by which new weights
    replace the old while the engine runs (`rl/weights.py`)."""

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int):
        layer.weight = parameter(torch.empty(out_features, in_features), 0, 1)

    def process_weights(self, layer: nn.Module) -> "LinearMethod":
        return self

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # normalise in float32 as transformers does, then scale in the model's dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight, eps: float):
    """(norm(x + residual), x + residual): the residual add fused with the next norm."""
    x = x + residual
    return rms_norm(x, weight, eps), x


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions, cos_sin: torch.Tensor):
    # q (T, nh, hs), k (T, nkv, hs); cos, sin (T, 1, hs/2) in q's dtype, as transformers
    cos, sin = cos_sin[positions].unsqueeze(1).to(q.dtype).chunk(2, dim=-1)
    return rotate(q, cos, sin), rotate(k, cos, sin)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


@dataclass
class Kernels:
    """What one model's layers compute with, chosen by its engine: its backend's
    attention functions (store_kvcache, prefill, decode), linear method and element-wise
    functions (the CPU's C kernels); its projections' method (a format's, or linear)."""

    backend: str
    attention: tuple
    linear: LinearMethod = field(default_factory=LinearMethod)
    projections: LinearMethod | None = None
    rms_norm: Callable = compiled_on_gpu(rms_norm)
    add_rms_norm: Callable = compiled_on_gpu(add_rms_norm, rows=2)
    silu_and_mul: Callable = compiled_on_gpu(silu_and_mul)
    rotary: Callable = compiled_on_gpu(apply_rotary, rows=3)

    def __post_init__(self) -> None:
        self.projections = self.projections or self.linear


class LinearBase(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, method):
        super().__init__()
        self.tp_rank = tp_rank()
        self.tp_size = tp_size()
        self.in_features = in_features  # this rank's, whatever format the method keeps
        self.out_features = out_features
        self.method = method
        method.create_weights(self, in_features, out_features)
        self.bias = parameter(torch.empty(out_features), 0) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)


def load_output_shard(layer, param, loaded: torch.Tensor, offset=0, size=None) -> None:
    """Copies this rank's slice of checkpoint tensor `loaded` (tensor-parallel ranks
    split its output features) into output features [offset, offset + size) of `param`
    (all of it if it has no output dim); a scalar (a part's scale) fills the part."""
    dim, pack = param.output_dim, param.output_pack
    if dim is None:
        return param.data.copy_(loaded)
    size = param.shape[dim] * pack if size is None else size
    if offset % pack or size % pack:
        raise ValueError(
            f"a part of {size} features at {offset} splits groups of {pack}"
        )
    if loaded.dim():
        loaded = tp_shard(loaded, dim, layer.tp_rank, layer.tp_size)
    param.data.narrow(dim, offset // pack, size // pack).copy_(loaded)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; no communication."""

    def __init__(self, in_features: int, out_features: int, bias: bool, method):
        super().__init__(in_features, out_features // tp_size(), bias, method)

    def weight_loader(self, param, loaded: torch.Tensor, shard_id=None) -> None:
        load_output_shard(self, param, loaded)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Column-parallel linears stored as one (gate and up projections): one matmul."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool, method):
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias, method)

    def weight_loader(self, param, loaded: torch.Tensor, shard_id: int) -> None:
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        load_output_shard(self, param, loaded, offset, size)


class QKVParallelLinear(ColumnParallelLinear):
    """The q, k and v projections as one linear; each rank holds its heads of all 3."""

    def __init__(self, hidden_size, head_dim, num_heads, num_kv_heads, bias, method):
        self.q_size = num_heads * head_dim // tp_size()
        self.kv_size = num_kv_heads * head_dim // tp_size()
        out_features = (num_heads + 2 * num_kv_heads) * head_dim
        super().__init__(hidden_size, out_features, bias, method)

    def weight_loader(self, param, loaded: torch.Tensor, shard_id: str) -> None:
        offset = {"q": 0, "k": self.q_size, "v": self.q_size + self.kv_size}[shard_id]
        size = self.q_size if shard_id == "q" else self.kv_size
        load_output_shard(self, param, loaded, offset, size)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; an all-reduce sums the partial outputs."""

    def __init__(self, in_features: int, out_features: int, bias: bool, method):
        super().__init__(in_features // tp_size(), out_features, bias, method)

    def weight_loader(self, param, loaded: torch.Tensor, shard_id=None) -> None:
        if param is self.bias:  # added once, on rank 0 only
            loaded = loaded if self.tp_rank == 0 else torch.zeros_like(loaded)
        elif param.input_dim is not None:  # else the same on every rank
            loaded = tp_shard(loaded, param.input_dim, self.tp_rank, self.tp_size)
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.method.apply(self, x)
        if self.tp_size > 1:
            dist.all_reduce(y)
        return y


class VocabParallelEmbedding(nn.Module):
    """Each rank holds a slice of the vocabulary; an all-reduce assembles the rows."""

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
    """Hidden states to logits over the whole vocabulary, gathered on every rank."""

    def __init__(self, vocab_size: int, hidden_size: int, method: LinearMethod):
        super().__init__(vocab_size, hidden_size)
        self.bias = None
        self.method = method

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.method.apply(self, hidden)
        if self.tp_size == 1:
            return logits
        shards = [torch.empty_like(logits) for _ in range(self.tp_size)]
        dist.all_gather(shards, logits)
        return torch.cat(shards, dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, kernels: Kernels):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.norm = kernels.rms_norm
        self.add_norm = kernels.add_rms_norm

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self.norm(x, self.weight, self.eps)
        return self.add_norm(x, residual, self.weight, self.eps)


# rope_type -> the inverse frequencies it makes of the plain ones; a model family above
# the core enters its scalings (nanopaged/models/rope.py)
ROPE_SCALINGS: dict[str, Callable] = {"default": lambda inv_freq, parameters: inv_freq}
# (head_dim, max_position, parameters, device) -> every position's cos and sin
ROPE_TABLES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


class RotaryEmbedding(nn.Module):
    """Rotary position embedding in the rotate-half layout of Qwen and Llama. Layers of
    the same parameters share one table (a long context's is hundreds of MB)."""

    def __init__(self, head_dim, max_position, parameters: dict, kernels: Kernels):
        super().__init__()
        self.rotary = kernels.rotary
        device = torch.get_default_device()
        key = (head_dim, max_position, str(sorted(parameters.items())), str(device))
        table = ROPE_TABLES.get(key)
        if table is None:
            exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
            inv_freq = 1.0 / parameters["rope_theta"] ** exponents
            inv_freq = ROPE_SCALINGS[rope_type(parameters)](inv_freq, parameters)
            positions = torch.arange(max_position, dtype=torch.float32)
            freqs = torch.outer(positions, inv_freq)
            table = ROPE_TABLES[key] = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
        self.register_buffer("cos_sin", table, persistent=False)  # (max_position, hs)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        return self.rotary(q, k, positions, self.cos_sin)


def rope_type(parameters: dict) -> str:
    return parameters.get("rope_type", parameters.get("type", "default"))
