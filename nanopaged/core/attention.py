"""Paged attention: store each new token's K/V in its cache slot, then attend through block tables.

The KV cache of one layer is two tensors of shape (num_blocks, block_size, num_kv_heads,
head_dim). Token `p` of a sequence lives in block `block_table[p // block_size]` at offset
`p % block_size`; its flat *slot* is `block * block_size + offset`. Three backends compute the
same function: plain PyTorch (the CPU path and the reference), Triton, and flash-attn; with a
`window`, a query sees the last `window` positions only. Shapes: T tokens of the step, B
sequences, L context length, nh query heads, nkv key/value heads, hs head size."""
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from nanopaged.core.sequence import cdiv


@dataclass
class AttentionMetadata:
    """What attention needs to know about one step's batch. In a ragged step sequence i runs the
    queries `cu_seqlens_q[i]:cu_seqlens_q[i+1]`, its last tokens among `context_lens[i]`;
    otherwise each runs one (a decode). Padding rows (CUDA graphs) have slot -1 and no context.
    `plans` keeps what a backend works out once a step for all its layers."""
    ragged: bool
    slot_mapping: torch.Tensor            # (num_tokens,) int64 cache slot of each new token
    context_lens: torch.Tensor            # (num_seqs,) int32 tokens in the cache after this step
    block_tables: torch.Tensor            # (num_seqs, max_blocks) int32, -1 past the end
    max_seqlen_k: int
    cu_seqlens_q: torch.Tensor | None = None  # (num_seqs + 1,) int32, ragged steps only
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 1
    plans: dict = field(default_factory=dict)


def store_kvcache_torch(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k, v: (T, nkv, hs) written to their slots; slot -1 (padding) is skipped."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    k_cache.view(-1, *k.shape[1:])[slots] = k[valid].to(k_cache.dtype)
    v_cache.view(-1, *v.shape[1:])[slots] = v[valid].to(v_cache.dtype)


def _gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """(B, nb) block ids -> (B, nkv, nb * bs, hs), their cache rows (block -1 reads block 0)."""
    num_seqs, num_blocks = block_tables.shape
    # index_select is faster here than cache[...]
    rows = cache.index_select(0, block_tables.flatten().clamp(min=0).long())
    return rows.view(num_seqs, num_blocks * cache.shape[1], *cache.shape[2:]).transpose(1, 2)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
            scale: float) -> torch.Tensor:
    """q: (B, nh, Q, hs) for Q queries, k/v: (B, nkv, L, hs), mask: (B, 1, Q, L), True where a
    query sees a key -> (B, nh, Q, hs). Query heads share key heads in groups (GQA)."""
    return F.scaled_dot_product_attention(q, k.to(q), v.to(q), mask, scale=scale, enable_gqa=True)


def prefill_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata, scale: float, window: int | None = None) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its whole cached context."""
    out = torch.empty_like(q)
    bounds, block_size = meta.cu_seqlens_q.tolist(), k_cache.shape[1]
    for i, context_len in enumerate(meta.context_lens.tolist()):
        start, end = bounds[i], bounds[i + 1]
        blocks = meta.block_tables[i:i + 1, :cdiv(context_len, block_size)]
        k, v = _gather_blocks(k_cache, blocks), _gather_blocks(v_cache, blocks)
        q_pos = torch.arange(context_len - (end - start), context_len, device=q.device)
        key_pos = torch.arange(k.shape[2], device=q.device)[None, :]
        mask = (key_pos <= q_pos[:, None]) & (key_pos > q_pos[:, None] - (window or k.shape[2]))
        queries = q[start:end].transpose(0, 1)[None]  # (1, nh, Q, hs)
        out[start:end] = _attend(queries, k, v, mask, scale)[0].transpose(0, 1)
    return out


def decode_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: AttentionMetadata, scale: float, window: int | None = None) -> torch.Tensor:
    """One query per sequence over its cached context, the batch padded to the longest."""
    k, v = _gather_blocks(k_cache, meta.block_tables), _gather_blocks(v_cache, meta.block_tables)
    key_pos, lens = torch.arange(k.shape[2], device=q.device)[None, :], meta.context_lens[:, None]
    mask = (key_pos < lens) & (key_pos >= lens - (window or k.shape[2]))  # (B, L)
    return _attend(q.unsqueeze(2), k, v, mask[:, None, None, :], scale).squeeze(2)


def prefill_flash(q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                  window: int | None = None) -> torch.Tensor:
    from flash_attn import flash_attn_varlen_func
    return flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q=meta.cu_seqlens_q,
                                  cu_seqlens_k=meta.cu_seqlens_k, max_seqlen_q=meta.max_seqlen_q,
                                  max_seqlen_k=meta.max_seqlen_k, softmax_scale=scale,
                                  causal=True, block_table=meta.block_tables,
                                  window_size=((window or 0) - 1, 0))  # -1: no window


def decode_flash(q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                 window: int | None = None) -> torch.Tensor:
    from flash_attn import flash_attn_with_kvcache
    # no right edge (-1, not causal's 0): only then does flash-attn read a GQA group's K/V once
    return flash_attn_with_kvcache(q.unsqueeze(1), k_cache, v_cache,
                                   cache_seqlens=meta.context_lens, block_table=meta.block_tables,
                                   softmax_scale=scale, window_size=((window or 0) - 1, -1)
                                   ).squeeze(1)


@dataclass
class Backend:
    """An attention backend: `load()` gives its (store_kvcache, prefill, decode) functions (its
    module imported only then); `missing(on_gpu, kv_dtype)` names what it lacks here (None:
    usable); "auto" may pick it on `auto_on` devices; `linear()` its linear method, `sample` its
    sampler's function (None: `LinearMethod`, `sampler.sample`), `zeros` allocates its cache."""
    load: Callable[[], tuple]
    missing: Callable[[bool, torch.dtype], str | None]
    auto_on: tuple[str, ...] = ("cuda", "cpu")
    linear: Callable[[], object] | None = None
    sample: Callable | None = None
    zeros: Callable[..., torch.Tensor] = torch.zeros


def _triton():
    from nanopaged.core import triton_attention as kernels
    return kernels.store_kvcache, kernels.prefill, kernels.decode


def _needs_triton(on_gpu: bool, dtype: torch.dtype) -> str | None:
    if not (on_gpu or os.environ.get("TRITON_INTERPRET") == "1"):  # Triton on CPU tensors: CI
        return "a CUDA GPU (or TRITON_INTERPRET=1)"
    return None if importlib.util.find_spec("triton") else "triton to be importable"


def _needs_flash(on_gpu: bool, kv_dtype: torch.dtype) -> str | None:
    if not on_gpu:
        return "a CUDA GPU"
    if not importlib.util.find_spec("flash_attn"):
        return "flash_attn to be importable"
    return None if kv_dtype in (torch.float16, torch.bfloat16) else "a float16 or bfloat16 KV cache"


# name -> backend, in the order "auto" tries them (plain "torch" last). A backend above the core
# enters itself here (nanopaged/cpu.py), as a model family enters `model.ARCHITECTURES`.
BACKENDS: dict[str, Backend] = {
    "flash": Backend(lambda: (_triton()[0], prefill_flash, decode_flash), _needs_flash, ("cuda",)),
    "triton": Backend(_triton, _needs_triton, ("cuda",)),
    "torch": Backend(lambda: (store_kvcache_torch, prefill_torch, decode_torch),
                     lambda on_gpu, dtype: None),
}


class Attention(nn.Module):
    """Multi-head attention over one layer's paged KV cache (`k_cache`, `v_cache`: views into
    the engine's KV tensor, set by `allocate_kv_cache`), scaled by head_dim ** -0.5 by default."""

    def __init__(self, head_dim: int, backend: str, scale: float | None = None,
                 sliding_window: int | None = None):
        super().__init__()
        self.scale = scale or head_dim ** -0.5
        self.window = sliding_window
        self.kernels = BACKENDS[backend].load()  # store_kvcache, prefill, decode
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        # q: (T, nh, hs), k/v: (T, nkv, hs)
        store_kvcache, prefill, decode = self.kernels
        store_kvcache(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        attend = prefill if meta.ragged else decode
        return attend(q, self.k_cache, self.v_cache, meta, self.scale, self.window)
