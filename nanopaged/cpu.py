"""The CPU backend: what makes the engine fast on a CPU, each part measured (docs/cpu.md).

`attention_backend="cpu"`, which "auto" picks on a CPU, computes what the plain "torch"
backend computes (the reference), with three changes:

- Decode attention reads the cache in groups of sequences of about the same length, each
  group's blocks small enough to stay in the CPU's cache while attention reads them: the
  plain backend copies every sequence's whole context, padded to the longest, into one tensor
  that does not fit there. Prefill runs each prompt's causal attention without a mask when it
  has no cached prefix (the fast path of PyTorch's CPU attention).
- Linear layers multiply with oneDNN's prepacked weights (`torch.ops.mkldnn`), 1.2x to 3x
  faster than `F.linear` here (most on the LM head of a large vocabulary); the plain weights
  of the projections are then freed.
- The process keeps freed memory for reuse (glibc's mmap and trim thresholds raised): a
  step's activations are tens of MB, which glibc would otherwise return to the OS after each
  use and fault in again, page by page; and torch's threads are as many as the cores this
  process may use (its CPU affinity and cgroup quota), not the machine's.
"""
import ctypes
import functools
import math
import os

import torch
import torch.nn.functional as F
from torch import nn

from nanopaged.core.attention import (BACKENDS, AttentionMetadata, Backend, _attend,
                                      _gather_blocks, decode_torch)
from nanopaged.core.layers import LinearBase, LinearMethod
from nanopaged.core.sequence import cdiv

# Padded K and V bytes of one group of decoding sequences: about what an L2 cache holds
GROUP_BYTES = 4 << 20
# glibc's mallopt parameters, and the size under which freed memory is kept
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, KEEP_BYTES = -1, -3, 2 ** 31 - 1


def usable_cores() -> int:
    """The cores this process may run on: its affinity mask, capped by a cgroup CPU quota."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    for path, scale in (("/sys/fs/cgroup/cpu.max", None),  # cgroup v2: "quota period"
                        ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "cpu.cfs_period_us")):
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
    """Once a process: no more torch threads than usable cores, and freed memory kept by glibc's
    allocator for the next step (see the module's docstring)."""
    if usable_cores() < torch.get_num_threads():  # setting it even unchanged slows small GEMMs
        torch.set_num_threads(usable_cores())
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(M_MMAP_THRESHOLD, KEEP_BYTES)
        libc.mallopt(M_TRIM_THRESHOLD, KEEP_BYTES)
    except (OSError, AttributeError):  # not glibc: its own allocator's policy stays
        pass


class PackedLinear(LinearMethod):
    """`F.linear` through oneDNN with the weight prepacked in its blocked layout, once loaded.
    The projections' plain weights are freed; the LM head's may be the embedding's too."""

    def process_weights(self, layer: nn.Module) -> None:
        if layer.weight.dtype not in (torch.float32, torch.bfloat16):  # what oneDNN packs
            layer.method = LinearMethod()
            return
        layer.packed_weight = torch.ops.mkldnn._reorder_linear_weight(layer.weight.data, 64)
        if isinstance(layer, LinearBase):
            layer.weight = None

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, layer.packed_weight, layer.bias, "none",
                                                  [None], "")


def prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            meta: AttentionMetadata, scale: float, window: int | None = None) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its cached context; a prompt
    with no cached prefix and no window needs no mask."""
    out = torch.empty_like(q)
    bounds, block_size = meta.cu_seqlens_q.tolist(), k_cache.shape[1]
    for i, context_len in enumerate(meta.context_lens.tolist()):
        start, end = bounds[i], bounds[i + 1]
        blocks = meta.block_tables[i:i + 1, :cdiv(context_len, block_size)]
        k, v = _gather_blocks(k_cache, blocks), _gather_blocks(v_cache, blocks)
        queries = q[start:end].transpose(0, 1)[None]  # (1, nh, Q, hs)
        if end - start == context_len and (window is None or window >= context_len):
            k, v = k[:, :, :context_len], v[:, :, :context_len]
            attended = F.scaled_dot_product_attention(queries, k, v, is_causal=True, scale=scale,
                                                      enable_gqa=True)
        else:
            q_pos = torch.arange(context_len - (end - start), context_len)[:, None]
            key_pos = torch.arange(k.shape[2])[None, :]
            mask = (key_pos <= q_pos) & (key_pos > q_pos - (window or k.shape[2]))
            attended = _attend(queries, k, v, mask, scale)
        out[start:end] = attended[0].transpose(0, 1)
    return out


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           meta: AttentionMetadata, scale: float, window: int | None = None) -> torch.Tensor:
    """One query per sequence over its cached context (or its last `window` tokens), the
    sequences in groups of about the same length (see `decode_groups`). A batch that fits one
    group is the plain backend's decode."""
    groups = meta.plans.get(("cpu decode", window))
    if groups is None:
        groups = meta.plans[("cpu decode", window)] = decode_groups(meta, window, k_cache)
    if groups == "one":
        return decode_torch(q, k_cache, v_cache, meta, scale, window)
    out = torch.empty_like(q)
    for rows, tables, mask in groups:
        k, v = _gather_blocks(k_cache, tables), _gather_blocks(v_cache, tables)
        out.index_copy_(0, rows, _attend(q[rows].unsqueeze(2), k, v, mask, scale).squeeze(2))
    return out


def decode_groups(meta: AttentionMetadata, window: int | None, k_cache: torch.Tensor):
    """The step's sequences in groups, shortest first, each group's K and V gathered from the
    blocks its keys are in and padded to its longest: GROUP_BYTES at most (unless one sequence
    alone is longer). Per group: its rows, their block tables (G, nb) and the keys each row
    sees (G, 1, 1, nb * block_size). Worked out once a step: every layer has the same groups."""
    block_size = k_cache.shape[1]
    token_bytes = 2 * k_cache[0, 0].numel() * k_cache.element_size()  # its K and V, all heads
    lens = meta.context_lens.tolist()
    if window is None and len(lens) * max(lens) * token_bytes <= GROUP_BYTES:
        return "one"
    # the first key each sequence sees, rounded down to its block
    firsts = [max(0, n - window) // block_size * block_size if window else 0 for n in lens]
    order = sorted(range(len(lens)), key=lambda i: lens[i] - firsts[i])
    groups, start = [], 0
    while start < len(order):
        end = start + 1
        while end < len(order) and (end + 1 - start) * token_bytes * (
                lens[order[end]] - firsts[order[end]]) <= GROUP_BYTES:
            end += 1
        rows = torch.tensor(order[start:end])
        first_blocks = torch.tensor([firsts[i] // block_size for i in order[start:end]])
        num_blocks = cdiv(lens[order[end - 1]] - firsts[order[end - 1]], block_size)
        columns = first_blocks[:, None] + torch.arange(num_blocks)[None, :]
        tables = meta.block_tables[rows].gather(
            1, columns.clamp(max=meta.block_tables.shape[1] - 1))
        key_pos = first_blocks[:, None] * block_size + torch.arange(num_blocks * block_size)
        seq_lens = meta.context_lens[rows][:, None]
        mask = (key_pos < seq_lens) & (key_pos >= seq_lens - (window or key_pos.shape[1]))
        groups.append((rows, tables, mask[:, None, None, :]))
        start = end
    return groups


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k, v: (T, nkv, hs) written to their slots (a CPU runs no CUDA graphs: no padding)."""
    k_cache.view(-1, *k.shape[1:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, slot_mapping, v)


def _load() -> tuple:
    tune_process()
    return store_kvcache, prefill, decode


BACKENDS["cpu"] = Backend(_load, lambda on_gpu, dtype: "device='cpu'" if on_gpu else None,
                          ("cpu",), PackedLinear if torch.backends.mkldnn.is_available() else None)
