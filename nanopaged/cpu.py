"""The CPU backend: what makes the engine fast on a CPU, each part measured (docs/cpu.md).

`attention_backend="cpu"`, which "auto" picks on a CPU, computes what the plain "torch"
backend computes (the reference), with these changes:

- Decode attention reads the cache in groups of sequences of about the same length, each
  group's blocks small enough to stay in the CPU's cache while attention reads them: the
  plain backend copies every sequence's whole context, padded to the longest, into one tensor
  that does not fit there. Prefill runs each prompt's causal attention without a mask when it
  has no cached prefix (the fast path of PyTorch's CPU attention).
- Linear layers multiply with oneDNN's prepacked weights (`torch.ops.mkldnn`), 1.2x to 3x
  faster than `F.linear` here (most on the LM head of a large vocabulary); the plain weights
  of the projections are then freed.
- Sampling searches the cumulative distribution in two levels, chunks first (`sample`).
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
# Tokens in a chunk of the vocabulary, whose sums a sample searches first
CHUNK = 128
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


@functools.cache
def packable_dtypes() -> tuple[torch.dtype, ...]:
    """What oneDNN packs here: float32, and bfloat16 on CPUs with its instructions (AVX-512 or
    AVX-NE-CONVERT; elsewhere a bfloat16 weight stays plain)."""
    bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return (torch.float32, torch.bfloat16) if bf16 else (torch.float32,)


class PackedLinear(LinearMethod):
    """`F.linear` through oneDNN with the weight prepacked in its blocked layout, once loaded.
    The projections' plain weights are freed; the LM head's may be the embedding's too."""

    def process_weights(self, layer: nn.Module) -> None:
        if layer.weight.dtype not in packable_dtypes():
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
            k, v = k[:, :, :context_len].to(q), v[:, :, :context_len].to(q)  # an FP8 cache
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
    sequences in groups of about the same length (see `decode_plan`). A batch that fits one
    group is the plain backend's decode."""
    key = ("cpu decode", window)
    if key not in meta.plans:
        meta.plans[key] = decode_plan(meta, window, k_cache)
    if meta.plans[key] is None:
        return decode_torch(q, k_cache, v_cache, meta, scale, window)
    order, groups = meta.plans[key]
    queries = q.index_select(0, order).unsqueeze(2)  # (B, nh, 1, hs), shortest context first
    outs, start = [], 0
    for blocks, mask in groups:
        size = len(mask)
        k, v = _rows(k_cache, blocks, size).to(q), _rows(v_cache, blocks, size).to(q)
        outs.append(F.scaled_dot_product_attention(queries[start:start + size], k, v,
                                                   attn_mask=mask, scale=scale, enable_gqa=True))
        start += size
    return torch.empty_like(q).index_copy_(0, order, torch.cat(outs).squeeze(2))


def _rows(cache: torch.Tensor, blocks: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """The cache blocks of `num_seqs` sequences, `blocks` (num_seqs * nb,) -> (num_seqs, nkv,
    nb * block_size, hs)."""
    rows = cache.index_select(0, blocks)
    return rows.view(num_seqs, -1, *cache.shape[2:]).transpose(1, 2)


def decode_plan(meta: AttentionMetadata, window: int | None, k_cache: torch.Tensor):
    """None when the batch's padded K and V fit GROUP_BYTES; otherwise the sequences sorted by
    the keys they see (`order`), cut into groups of at most GROUP_BYTES of K and V each, padded
    to their longest (a sequence longer than that alone is a group). Per group: the cache
    blocks its keys are in, row after row (G * nb,), and the additive mask of the keys each
    row sees (G, 1, 1, nb * block_size). Worked out once a step: every layer has the same."""
    block_size = k_cache.shape[1]
    token_bytes = 2 * k_cache[0, 0].numel() * k_cache.element_size()  # its K and V, all heads
    lens = meta.context_lens.tolist()
    if window is None and len(lens) * max(lens) * token_bytes <= GROUP_BYTES:
        return None
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
        blocks = meta.block_tables[rows].gather(
            1, columns.clamp(max=meta.block_tables.shape[1] - 1))
        key_pos = first_blocks[:, None] * block_size + torch.arange(num_blocks * block_size)
        seq_lens = meta.context_lens[rows][:, None]
        seen = (key_pos < seq_lens) & (key_pos >= seq_lens - (window or key_pos.shape[1]))
        mask = torch.zeros(seen.shape).masked_fill_(~seen, float("-inf"))
        groups.append((blocks.flatten().clamp(min=0).long(), mask[:, None, None, :]))
        start = end
    return torch.tensor(order), groups


def sample(logits: torch.Tensor, temperatures: torch.Tensor, uniform: torch.Tensor
           ) -> torch.Tensor:
    """`sampler.sample` (the first token whose cumulative probability under softmax(logits / T)
    exceeds `uniform`) in two levels: a cumulative sum is sequential, 2.3x slower here than
    summing CHUNK tokens at a time, so the sums of the chunks are searched first, then the one
    chunk found. Each target stays under its total: rounding never picks a token of
    probability 0 (one that top-k, top-p or min-p removed)."""
    shifted = logits.float() - logits.float().amax(dim=-1, keepdim=True)  # <= 0: no overflow
    # tempered in place: no second (R, V) buffer to fill
    probs = torch.softmax(shifted.div_(temperatures.unsqueeze(1)), dim=-1)
    size = CHUNK if probs.shape[1] % CHUNK == 0 else probs.shape[1]
    chunks = probs.view(len(probs), -1, size)
    ends = chunks.sum(dim=-1).cumsum(dim=-1)  # (R, V / size): the mass up to each chunk's end
    target = torch.minimum(uniform.unsqueeze(1) * ends[:, -1:], _below(ends[:, -1:]))
    chunk = torch.searchsorted(ends, target, right=True)
    inner = chunks.gather(1, chunk.unsqueeze(2).expand(-1, 1, size)).squeeze(1).cumsum(dim=-1)
    target = (target - ends.gather(1, chunk) + inner[:, -1:]).clamp(min=0)  # into the chunk
    token = torch.searchsorted(inner, torch.minimum(target, _below(inner[:, -1:])), right=True)
    return (chunk * size + token).squeeze(1)


def _below(total: torch.Tensor) -> torch.Tensor:
    return total.nextafter(torch.zeros_like(total))  # the largest float under the total


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k, v: (T, nkv, hs) written to their slots (a CPU runs no CUDA graphs: no padding); into
    an FP8 cache as bytes, for which index_copy_ has a kernel."""
    for new, cache in ((k, k_cache), (v, v_cache)):
        new = new.to(cache.dtype)
        if cache.dtype == torch.float8_e4m3fn:
            new = new.view(torch.uint8)
            cache = cache.view(torch.uint8)
        cache.view(-1, *new.shape[1:]).index_copy_(0, slot_mapping, new)


def _load() -> tuple:
    tune_process()
    return store_kvcache, prefill, decode


BACKENDS["cpu"] = Backend(_load, lambda on_gpu, dtype: "device='cpu'" if on_gpu else None,
                          ("cpu",), PackedLinear if torch.backends.mkldnn.is_available() else None,
                          sample)
