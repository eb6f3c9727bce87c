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
- While an engine lives, the process keeps freed memory for reuse (glibc's mmap and trim
  thresholds raised; glibc's defaults are back, and the memory returned, once the last
  such engine is gone): a step's activations are tens of MB, which glibc would otherwise
  return to the OS after each use and fault in again, page by page. Torch's threads are
  as many as the cores this process may use (its CPU affinity and cgroup quota), not
  the machine's.
"""

import ctypes
import functools
import math
import mmap
import os
import weakref

import torch
from torch import nn

from nanopaged.core import sampler
from nanopaged.core.attention import (
    BACKENDS,
    AttentionMetadata,
    Backend,
    decode_torch,
    prefill_torch,
)
from nanopaged.core.layers import Kernels, LinearBase, LinearMethod
from nanopaged.cpu import kernels as cpu_kernels

# Queries a sequence, at most, for which a prefill step attends a query at a time (a
# speculative verification, a small chunk): more, and tiles of matrix products are
# faster
KERNEL_QUERIES = 16
# glibc's mallopt parameters, the size under which freed memory is kept while an engine
# lives, and glibc's default
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
KEEP_BYTES, GLIBC_THRESHOLD = 2**31 - 1, 128 << 10


def usable_cores() -> int:
    """The cores this process may run on: its affinity mask, capped by a cgroup CPU
    quota."""
    cores = (
        len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else os.cpu_count()
    )
    for path, scale in (
        ("/sys/fs/cgroup/cpu.max", None),  # cgroup v2: "quota period"
        ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "cpu.cfs_period_us"),
    ):
        try:
            with open(path) as f:
                quota, *period = f.read().split()
            if scale:
                with open(os.path.join(os.path.dirname(path), scale)) as f:
                    period = [f.read()]
        except OSError:
            continue
        if quota not in ("max", "-1"):
            cores = min(cores, max(1, math.ceil(int(quota) / int(period[0]))))
        break
    return max(1, cores or 1)


@functools.cache
def tune_process() -> None:
    """Once a process: no more torch threads than usable cores."""
    # setting it even unchanged slows small GEMMs
    if usable_cores() < torch.get_num_threads():
        torch.set_num_threads(usable_cores())


# the engines alive that asked glibc to keep freed memory
_keeping = 0


def keep_freed_memory(kv_cache: torch.Tensor) -> None:
    """While the engine of `kv_cache` lives, glibc keeps the memory a step frees for the
    next (its mmap and trim thresholds raised: see the module's docstring); once the
    last such engine is gone, glibc's default thresholds (128 KB) come back and the
    kept memory is returned to the system. No-op where the allocator is not glibc's."""
    try:
        libc = glibc()
        libc.mallopt(M_MMAP_THRESHOLD, KEEP_BYTES)
        libc.mallopt(M_TRIM_THRESHOLD, KEEP_BYTES)
    except (OSError, AttributeError):  # not glibc: its own allocator's policy stays
        return
    global _keeping
    _keeping += 1
    weakref.finalize(kv_cache, _release_freed_memory, libc)


def glibc() -> ctypes.CDLL:
    return ctypes.CDLL("libc.so.6")


def _release_freed_memory(libc) -> None:
    global _keeping
    _keeping -= 1
    if _keeping == 0:  # the last engine keeping memory is gone
        libc.mallopt(M_MMAP_THRESHOLD, GLIBC_THRESHOLD)
        libc.mallopt(M_TRIM_THRESHOLD, GLIBC_THRESHOLD)
        libc.malloc_trim(0)


def kv_zeros(shape: tuple[int, ...], dtype: torch.dtype, device="cpu") -> torch.Tensor:
    """The backend's KV cache: `huge_zeros`, and freed memory kept while it lives."""
    kv_cache = huge_zeros(shape, dtype, device)
    keep_freed_memory(kv_cache)
    return kv_cache


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
    panels (`PanelLinear`), else in oneDNN's blocked layout where oneDNN packs its
    dtype. The projections' plain weights are freed; the LM head's may be the
    embedding's too."""

    def process_weights(self, layer: nn.Module) -> LinearMethod:
        panels = None
        if cpu_kernels.panels_faster():  # measured on this machine
            panels = cpu_kernels.pack_panels(layer.weight.data)
        if panels is not None:
            layer.panels = huge_zeros(panels.shape, panels.dtype).copy_(panels)
            method = PanelLinear()
        elif layer.weight.dtype in packable_dtypes():
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


class PanelLinear(LinearMethod):
    """The C kernels' matmul over the weight in panels (`cpu_kernels.panel_matmul`):
    each panel read once for all the rows, 15-30% faster than oneDNN at decode sizes, as
    fast on a prefill (docs/cpu.md)."""

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        out = cpu_kernels.panel_matmul(x, layer.panels)
        return out if layer.bias is None else out.add_(layer.bias)


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
    """k, v: (T, nkv, hs) written to their slots (a CPU runs no CUDA graphs: no
    padding): by the C kernel into a float32 cache; else into an FP8 cache as bytes, for
    which index_copy_ has a kernel."""
    if cpu_kernels.store_kv(k, v, k_cache, v_cache, slot_mapping):
        return
    for new, cache in ((k, k_cache), (v, v_cache)):
        new = new.to(cache.dtype)
        if cache.dtype == torch.float8_e4m3fn:
            new = new.view(torch.uint8)
            cache = cache.view(torch.uint8)
        cache.view(-1, *new.shape[1:]).index_copy_(0, slot_mapping, new)


def model_kernels() -> Kernels:
    """What a model built for this backend computes with: the C kernels where they are
    built (else PyTorch's), the linear layers packed where oneDNN is."""
    tune_process()
    linear = PackedLinear() if torch.backends.mkldnn.is_available() else LinearMethod()
    attention = (store_kvcache, prefill, decode)
    if cpu_kernels.library() is None:
        return Kernels("cpu", attention, linear)
    return Kernels("cpu", attention, linear, **cpu_kernels.ELEMENTWISE)


BACKENDS["cpu"] = Backend(
    model_kernels,
    lambda on_gpu, dtype: "device='cpu'" if on_gpu else None,
    ("cpu",),
    sample,
    kv_zeros,
)
