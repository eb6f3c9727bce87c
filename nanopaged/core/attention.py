"""Paged attention: store each new token's K/V in its cache slot, then attend through
block tables. A layer's cache is two tensors (num_blocks, block_size, nkv, hs); token
`p` of a sequence lives in block `block_table[p // block_size]` at offset
`p % block_size`, its *slot* `block * block_size + offset`. Each backend computes the
functions of plain PyTorch here (the CPU path and the reference): `store_kvcache(k, v,
k_cache, v_cache, slot_mapping)`, then `prefill` or `decode(q, k_cache, v_cache, meta,
scale, window)`, each query seeing only the last `window` positions if given. Shapes:
T tokens, B sequences, L context, nh query and nkv K/V heads of size hs."""

import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nanopaged.core.layers import Kernels
from nanopaged.core.sequence import cdiv


@dataclass
class AttentionMetadata:
    """What attention needs to know about one step's batch. In a ragged step sequence i
    runs the queries `cu_seqlens_q[i]:cu_seqlens_q[i+1]`, its last tokens among
    `context_lens[i]`; otherwise each runs one (a decode). Padding rows (CUDA graphs)
    have slot -1 and no context."""

    ragged: bool
    slot_mapping: torch.Tensor  # (T,) int64: each new token's cache slot
    context_lens: torch.Tensor  # (B,) int32: tokens in the cache after this step
    block_tables: torch.Tensor  # (B, max_blocks) int32, -1 past the end
    max_seqlen_k: int
    cu_seqlens_q: torch.Tensor | None = None  # (B + 1,) int32, ragged steps only
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 1


def store_kvcache_torch(k, v, k_cache, v_cache, slot_mapping) -> None:
    """k, v: (T, nkv, hs) written to their slots; slot -1 (padding) is skipped."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    k_cache.view(-1, *k.shape[1:])[slots] = k[valid].to(k_cache.dtype)
    v_cache.view(-1, *v.shape[1:])[slots] = v[valid].to(v_cache.dtype)


def gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """(B, nb) block ids -> (B, nkv, nb * bs, hs), their rows (-1 reads block 0)."""
    num_seqs, num_blocks = block_tables.shape
    # index_select is faster here than cache[...]
    rows = cache.index_select(0, block_tables.flatten().clamp(min=0).long())
    rows = rows.view(num_seqs, num_blocks * cache.shape[1], *cache.shape[2:])
    return rows.transpose(1, 2)


def attend(q, k, v, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q: (B, nh, Q, hs) for Q queries, k/v: (B, nkv, L, hs), mask: (B, 1, Q, L), True
    where a query sees a key -> (B, nh, Q, hs). Query heads share key heads (GQA)."""
    k, v = k.to(q), v.to(q)
    return F.scaled_dot_product_attention(q, k, v, mask, scale=scale, enable_gqa=True)


def prefill_torch(q, k_cache, v_cache, meta, scale, window=None) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its whole cached context."""
    out = torch.empty_like(q)
    bounds, block_size = meta.cu_seqlens_q.tolist(), k_cache.shape[1]
    for i, context_len in enumerate(meta.context_lens.tolist()):
        start, end = bounds[i], bounds[i + 1]
        blocks = meta.block_tables[i : i + 1, : cdiv(context_len, block_size)]
        k, v = gather_blocks(k_cache, blocks), gather_blocks(v_cache, blocks)
        q_pos = torch.arange(context_len - (end - start), context_len, device=q.device)
        q_pos = q_pos[:, None]
        key_pos = torch.arange(k.shape[2], device=q.device)[None, :]
        mask = (key_pos <= q_pos) & (key_pos > q_pos - (window or k.shape[2]))
        queries = q[start:end].transpose(0, 1)[None]  # (1, nh, Q, hs)
        out[start:end] = attend(queries, k, v, mask, scale)[0].transpose(0, 1)
    return out


def decode_torch(q, k_cache, v_cache, meta, scale, window=None) -> torch.Tensor:
    """One query per sequence over its cached context, padded to the longest."""
    k = gather_blocks(k_cache, meta.block_tables)
    v = gather_blocks(v_cache, meta.block_tables)
    key_pos = torch.arange(k.shape[2], device=q.device)[None, :]
    lens = meta.context_lens[:, None]
    mask = (key_pos < lens) & (key_pos >= lens - (window or k.shape[2]))  # (B, L)
    return attend(q.unsqueeze(2), k, v, mask[:, None, None, :], scale).squeeze(2)


def prefill_flash(q, k_cache, v_cache, meta, scale, window=None) -> torch.Tensor:
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func(
        q,
        k_cache,
        v_cache,
        cu_seqlens_q=meta.cu_seqlens_q,
        cu_seqlens_k=meta.cu_seqlens_k,
        max_seqlen_q=meta.max_seqlen_q,
        max_seqlen_k=meta.max_seqlen_k,
        softmax_scale=scale,
        causal=True,
        block_table=meta.block_tables,
        window_size=((window or 0) - 1, 0),  # -1: no window
    )


def decode_flash(q, k_cache, v_cache, meta, scale, window=None) -> torch.Tensor:
    from flash_attn import flash_attn_with_kvcache

    # no right edge (-1, not causal's 0): only so does flash-attn read a GQA group once
    out = flash_attn_with_kvcache(
        q.unsqueeze(1),
        k_cache,
        v_cache,
        cache_seqlens=meta.context_lens,
        block_table=meta.block_tables,
        softmax_scale=scale,
        window_size=((window or 0) - 1, -1),
    )
    return out.squeeze(1)


@dataclass
class Backend:
    """An attention backend: `kernels()` gives what a model built for it computes with
    (its module imported only then); `missing(on_gpu, kv_dtype)` names what it lacks
    here (None: usable); "auto" picks it on `auto_on` devices; `zeros` allocates its KV
    cache; `graphs(model, config, max_blocks_per_seq)` makes what replays its decode
    steps, where it is not CUDA graphs (`cuda_graphs.DecodeGraphs`). Its sampling
    kernel, if it has one, is in `sampler.SAMPLING_KERNELS`."""

    kernels: Callable[[], Kernels]
    missing: Callable[[bool, torch.dtype], str | None]
    auto_on: tuple[str, ...] = ("cuda", "cpu")
    zeros: Callable[..., torch.Tensor] = torch.zeros
    graphs: Callable | None = None


def triton_kernels() -> tuple:
    """The Triton kernels: (store_kvcache, prefill, decode), imported only now."""
    from nanopaged.core.triton_attention import prefill, store_kvcache
    from nanopaged.core.triton_decode_attention import decode

    return store_kvcache, prefill, decode


def flash_kernels() -> Kernels:
    """flash-attn's prefill and decode, and the Triton kernel that stores K/V."""
    store_kvcache, _, _ = triton_kernels()
    return Kernels("flash", (store_kvcache, prefill_flash, decode_flash))


def needs_triton(on_gpu: bool, kv_dtype: torch.dtype) -> str | None:
    if not on_gpu and os.environ.get("TRITON_INTERPRET") != "1":  # Triton on CPU: CI
        return "a CUDA GPU (or TRITON_INTERPRET=1)"
    return None if importlib.util.find_spec("triton") else "triton to be importable"


def needs_flash(on_gpu: bool, kv_dtype: torch.dtype) -> str | None:
    if not on_gpu:
        return "a CUDA GPU"
    if not importlib.util.find_spec("flash_attn"):
        return "flash_attn to be importable"
    if kv_dtype not in (torch.float16, torch.bfloat16):
        return "a float16 or bfloat16 KV cache"
    return None


TORCH = (store_kvcache_torch, prefill_torch, decode_torch)
# name -> backend, in the order "auto" tries them (plain "torch" last). A backend above
# the core is entered here by nanopaged/features.py (the CPU's), as a model family is
# in ARCHITECTURES.
BACKENDS: dict[str, Backend] = {
    "flash": Backend(flash_kernels, needs_flash, ("cuda",)),
    "triton": Backend(
        lambda: Kernels("triton", triton_kernels()), needs_triton, ("cuda",)
    ),
    "torch": Backend(lambda: Kernels("torch", TORCH), lambda on_gpu, kv_dtype: None),
}


class Attention(nn.Module):
    """Multi-head attention over one layer's paged KV cache (`k_cache`, `v_cache`: views
    of the engine's KV tensor, set by `CausalLM.bind_kv_cache`), scaled by head_dim **
    -0.5 unless `scale` says otherwise."""

    def __init__(self, head_dim: int, kernels: Kernels, scale=None, window=None):
        super().__init__()
        self.scale = scale or head_dim**-0.5
        self.window = window
        self.kernels = kernels.attention  # store_kvcache, prefill, decode
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(self, q, k, v, meta: AttentionMetadata) -> torch.Tensor:
        # q: (T, nh, hs), k/v: (T, nkv, hs)
        store_kvcache, prefill, decode = self.kernels
        store_kvcache(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        attend = prefill if meta.ragged else decode
        return attend(q, self.k_cache, self.v_cache, meta, self.scale, self.window)
