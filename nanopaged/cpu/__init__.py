"""The CPU backend: what makes the engine fast on a CPU, each part measured
(docs/cpu.md).

`attention_backend="cpu"`, which "auto" picks on a CPU, computes what the plain "torch"
backend computes (the reference), with these changes:

- Attention reads each sequence's K/V blocks where they lie in the cache, in C
  (`kernels.c`: the Triton kernels' online softmax in a loop nest), a query at a
  time in decode steps and small chunks, in tiles of matrix products in prefills; the
  plain backend copies every context out of the cache first.
- The core's fused element-wise functions (RMSNorm, RoPE, SiLU-and-multiply) and
  sampling run in C too: at decode sizes PyTorch's small operators cost more in dispatch
  than in arithmetic.
- Linear layers multiply float32 weights packed in panels by the C kernels' matmul,
  others with oneDNN's prepacked weights (`torch.ops.mkldnn`): 1.2x to 3x faster than
  `F.linear` here (most on the LM head of a large vocabulary); the plain weights of the
  projections are freed.
- The KV cache and the panels lie in memory Linux may back by 2 MB pages (transparent
  huge pages, asked for with madvise: the default "madvise" mode grants them only then).
  A decode step reads the cache's blocks where they lie and the LM head's tens of MB:
  with 4 KB pages, a miss in the TLB every 4 KB, each a page-table walk (two levels deep
  in a VM).
- The kernels run on threads of the C library's own, as many as torch's count but never
  more than the cores this process may use (its CPU affinity and cgroup quota), and wait
  between kernels as the engine needs: spinning a while alone on the cores, briefly
  beside other busy threads (`kernels.c`). Nothing of the process changes: no
  environment variable, no thread count, no allocator setting (docs/cpu.md).
"""

import functools
import math
import mmap

import torch
from torch import nn

from nanopaged.core import sampler
from nanopaged.core.attention import (
    AttentionMetadata,
    Backend,
    decode_torch,
    prefill_torch,
)
from nanopaged.core.config import Config
from nanopaged.core.layers import Kernels, LinearBase, LinearMethod
from nanopaged.cpu import kernels as cpu_kernels
from nanopaged.cpu.kernels import usable_cores  # noqa: F401 (the cpu package's name)
from nanopaged.cpu.step_graph import StepGraphs

# Queries a sequence, at most, for which a prefill step attends a query at a time (a
# speculative verification, a small chunk): more, and tiles of matrix products are
# faster
KERNEL_QUERIES = 16


@functools.cache
def packable_dtypes() -> tuple[torch.dtype, ...]:
    """What oneDNN packs here: float32, and bfloat16 on CPUs with its instructions
    (AVX-512 or AVX-NE-CONVERT; elsewhere a bfloat16 weight stays plain)."""
    bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return (torch.float32, torch.bfloat16) if bf16 else (torch.float32,)


def huge_zeros(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """torch.zeros(shape, dtype=dtype) in an anonymous mapping that Linux may back by
    huge pages (see the module's docstring); its pages cost no memory until written.
    Elsewhere (no madvise), torch.zeros."""
    count = math.prod(shape)
    if not hasattr(mmap, "MADV_HUGEPAGE") or count == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    memory = mmap.mmap(
        -1, count * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    )
    try:
        memory.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel without transparent huge pages: 4 KB pages, as torch's
        pass
    return torch.frombuffer(memory, dtype=dtype, count=count).view(shape)


class PackedLinear(LinearMethod):
    """`F.linear` with the weight packed once loaded: a float32 weight in the C kernels'
    panels (`PanelLinear`, on the library's threads), else in oneDNN's blocked layout
    where oneDNN packs its dtype, else as it is. The projections' plain weights are
    freed; the LM head's may be the embedding's too."""

    def process_weights(self, layer: nn.Module) -> LinearMethod:
        panels = cpu_kernels.pack_panels(layer.weight.data)
        onednn = torch.backends.mkldnn.is_available()
        if panels is not None:
            layer.panels = huge_zeros(panels.shape, panels.dtype).copy_(panels)
            method = PanelLinear()
        elif onednn and layer.weight.dtype in packable_dtypes():
            layer.packed_weight = torch.ops.mkldnn._reorder_linear_weight(
                layer.weight.data, 64
            )
            method = self
        else:
            return LinearMethod()
        if isinstance(layer, LinearBase):
            layer.weight = None
        return method

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(
            x, layer.packed_weight, layer.bias, "none", [None], ""
        )

    def dense_weight(self, layer: nn.Module) -> torch.Tensor:
        """The plain (out, in) weight, out of oneDNN's layout (a copy)."""
        return layer.packed_weight.to_dense()

    def set_dense_weight(self, layer: nn.Module, weight: torch.Tensor) -> None:
        """Packs `weight` into the layer's packed weight, in place (a step graph
        reads it there)."""
        layer.packed_weight.copy_(
            torch.ops.mkldnn._reorder_linear_weight(
                weight.to(layer.packed_weight.dtype), 64
            )
        )


class PanelLinear(LinearMethod):
    """The C kernels' matmul over the weight in panels (`cpu_kernels.panel_matmul`):
    each panel read once for all the rows. On the AMD EPYC VMs without AVX-512 1.3-1.6x
    faster than oneDNN at this model's decode shapes; on an Intel Xeon with AVX-512
    oneDNN was faster (docs/cpu.md), but it runs on OpenMP's threads, which spin
    between operators beside other processes."""

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        out = cpu_kernels.panel_matmul(x, layer.panels)
        return out if layer.bias is None else out.add_(layer.bias)

    def dense_weight(self, layer: nn.Module) -> torch.Tensor:
        """The plain (out, in) weight, out of its panels (a copy)."""
        panels, k = layer.panels, layer.panels.shape[1]
        return panels.transpose(1, 2).reshape(-1, k)

    def set_dense_weight(self, layer: nn.Module, weight: torch.Tensor) -> None:
        """Packs `weight` into the layer's panels, in place (a step graph reads them
        there)."""
        layer.panels.copy_(cpu_kernels.pack_panels(weight.float()))


def prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its cached context, read in
    place by the C kernels: a query at a time in a step of at most KERNEL_QUERIES a
    sequence, else in tiles of matrix products (the plain backend's prefill where they
    do not apply)."""
    out = cpu_kernels.paged_attention(
        q,
        k_cache,
        v_cache,
        meta.block_tables,
        meta.context_lens,
        meta.cu_seqlens_q,
        scale,
        window,
        tiled=meta.max_seqlen_q > KERNEL_QUERIES,
    )
    return (
        prefill_torch(q, k_cache, v_cache, meta, scale, window) if out is None else out
    )


def decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """One query per sequence over its cached context, read in place by the C kernel
    (the plain backend's decode where it does not apply)."""
    out = cpu_kernels.paged_attention(
        q, k_cache, v_cache, meta.block_tables, meta.context_lens, None, scale, window
    )
    return (
        decode_torch(q, k_cache, v_cache, meta, scale, window) if out is None else out
    )


def sample(
    logits: torch.Tensor, temperatures: torch.Tensor, uniform: torch.Tensor
) -> torch.Tensor:
    """`sampler.sample` by the C kernel: in two levels, chunks first, and never a token
    of probability 0 (one that top-k, top-p or min-p removed), whatever the rounding."""
    tokens = cpu_kernels.sample(logits, temperatures, uniform)
    return sampler.sample(logits, temperatures, uniform) if tokens is None else tokens


def store_kvcache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k, v: (T, nkv, hs) written to their slots, slot -1 (a step graph's padding row)
    skipped: by the C kernel, in the cache's dtype; without it, by index_copy_ (into an
    FP8 cache as bytes, for which index_copy_ has a kernel)."""
    if cpu_kernels.store_kv(k, v, k_cache, v_cache, slot_mapping):
        return
    valid = slot_mapping >= 0
    for new, cache in ((k, k_cache), (v, v_cache)):
        new = new[valid].to(cache.dtype)
        if cache.dtype == torch.float8_e4m3fn:
            new = new.view(torch.uint8)
            cache = cache.view(torch.uint8)
        cache.view(-1, *new.shape[1:]).index_copy_(0, slot_mapping[valid], new)


def model_kernels() -> Kernels:
    """What a model built for this backend computes with: the C kernels where they are
    built (else PyTorch's), the linear layers packed (`PackedLinear`)."""
    linear = PackedLinear()
    attention = (store_kvcache, prefill, decode)
    if cpu_kernels.library() is None:
        return Kernels("cpu", attention, linear)
    return Kernels("cpu", attention, linear, **cpu_kernels.ELEMENTWISE)


def step_graphs(
    model: nn.Module, config: Config, max_blocks_per_seq: int
) -> StepGraphs:
    """The decode steps' graphs (`step_graph.py`), for a model whose linear methods are
    this backend's or plain: another's Python may differ between steps."""
    methods = (LinearMethod, PackedLinear, PanelLinear)
    return StepGraphs(model, config, max_blocks_per_seq, methods)


BACKEND = Backend(
    model_kernels,
    lambda on_gpu, dtype: "device='cpu'" if on_gpu else None,
    ("cpu",),
    huge_zeros,
    step_graphs,
)
