"""Triton kernels for the paged KV cache: store new K/V, and prefill attention (decode's
are in `triton_decode_attention.py`), with the tiles both attend over.

Each kernel finds a token's K/V through the block table, so any block size works, and
each is checked against the plain-PyTorch functions of `attention.py` (under
TRITON_INTERPRET=1 on CPU). `prefill` and `decode` are the backend as `attention.py`
calls them (with a step's metadata); the kernels themselves take plain tensors.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kvcache_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    k_stride,
    v_stride,
    ROW: tl.constexpr,
    ROW_PAD: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot >= 0:  # -1 marks a padding token
        cols = tl.arange(0, ROW_PAD)
        mask = cols < ROW
        k = tl.load(k_ptr + token * k_stride + cols, mask=mask)
        v = tl.load(v_ptr + token * v_stride + cols, mask=mask)
        tl.store(k_cache_ptr + slot * ROW + cols, k, mask=mask)
        tl.store(v_cache_ptr + slot * ROW + cols, v, mask=mask)


def store_kvcache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k, v: (T, nkv, hs), each token's heads contiguous; one program per token. Cast to
    the cache's dtype first (an FP8 cache): torch rounds them as every backend does."""
    k = k.to(k_cache.dtype)
    v = v.to(v_cache.dtype)
    num_tokens, num_kv_heads, head_dim = k.shape
    row = num_kv_heads * head_dim
    assert k.stride(1) == head_dim and v.stride(1) == head_dim and k.stride(2) == 1
    _store_kvcache_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        v.stride(0),
        row,
        triton.next_power_of_2(row),
    )


@triton.jit
def kv_tiles(
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    pos,
    valid,
    kv_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """K and V of the tokens at positions `pos` of one sequence, one head: (BLOCK_N,
    HEAD_DIM) each, found once through the block table."""
    block = tl.load(block_table_ptr + pos // BLOCK_SIZE, mask=valid, other=0).to(
        tl.int64
    )
    slot = block * BLOCK_SIZE + pos % BLOCK_SIZE
    dims = tl.arange(0, HEAD_DIM)
    offsets = (slot * NUM_KV_HEADS + kv_head)[:, None] * HEAD_DIM + dims[None, :]
    return (
        tl.load(k_cache_ptr + offsets, mask=valid[:, None], other=0.0),
        tl.load(v_cache_ptr + offsets, mask=valid[:, None], other=0.0),
    )


# Integer arguments that change from step to step are not specialised on, or each new
# value (a block table one column wider, say) would compile the kernel again in the
# middle of a run.
@triton.jit
def attend_tile(q, k, v, mask, m, l_sum, acc, scale, PRECISION: tl.constexpr):
    """One step of online softmax: folds the keys k and values v (N, D) that `mask`
    (R, N) lets each query row see into the rows' running max m, sum l_sum and output
    acc (R, D). Keys and values of an FP8 cache are read in the queries' dtype."""
    k = k.to(q.dtype)
    v = v.to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    s = s * (scale * 1.4426950408889634)  # log2 e: the softmax in powers of 2
    s = tl.where(mask, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m - m_new)
    l_sum = l_sum * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_sum, acc


def precision(q: torch.Tensor) -> str:
    """float32 runs are compared token-for-token with transformers: no TF32 shortcuts
    there."""
    return "ieee" if q.dtype == torch.float32 else "tf32"


@triton.jit(do_not_specialize=["block_table_stride", "window"])
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    cu_seqlens_q_ptr,
    context_lens_ptr,
    block_tables_ptr,
    scale,
    q_stride,
    block_table_stride,
    window,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One program: BLOCK_M queries of one sequence and one head, attending causally
    over the sequence's cached prefix and its new tokens (or their last `window`, when
    not 0), all read through the block table."""
    tile_m, seq, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if tile_m * BLOCK_M < q_len:
        context_len = tl.load(context_lens_ptr + seq)
        prefix_len = context_len - q_len
        rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_valid = rows < q_len
        q_pos = prefix_len + rows
        dims = tl.arange(0, HEAD_DIM)
        q_offsets = (
            (q_start + rows)[:, None] * q_stride + head * HEAD_DIM + dims[None, :]
        )
        q = tl.load(q_ptr + q_offsets, mask=row_valid[:, None], other=0.0)  # (M, D)
        kv_head = head // (NUM_HEADS // NUM_KV_HEADS)
        m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_sum = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
        block_table_ptr = block_tables_ptr + seq * block_table_stride
        # causal horizon
        end = tl.minimum(context_len, prefix_len + (tile_m + 1) * BLOCK_M)
        first = tl.where(
            window > 0, tl.maximum(prefix_len + tile_m * BLOCK_M - window + 1, 0), 0
        )
        for tile in range(first, end, BLOCK_N):
            pos = tile + tl.arange(0, BLOCK_N)
            valid = pos < end
            k, v = kv_tiles(
                k_cache_ptr,
                v_cache_ptr,
                block_table_ptr,
                pos,
                valid,
                kv_head,
                NUM_KV_HEADS,
                HEAD_DIM,
                BLOCK_SIZE,
            )
            causal = (
                valid[None, :]
                & (pos[None, :] <= q_pos[:, None])
                & ((pos[None, :] > q_pos[:, None] - window) | (window <= 0))
            )
            m, l_sum, acc = attend_tile(
                q, k, v, causal, m, l_sum, acc, scale, PRECISION
            )
        out = acc / l_sum[:, None]
        tl.store(
            out_ptr + q_offsets,
            out.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None],
        )


def prefill_paged(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_seqlen_q: int,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """q: (T, nh, hs), the ragged new queries of each sequence; the arguments are those
    of `attention.AttentionMetadata`, and a sliding `window` (0: none)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    num_seqs = context_lens.shape[0]
    q = q.contiguous()
    out = torch.empty_like(q)
    block_m = 64
    grid = (triton.cdiv(max_seqlen_q, block_m), num_seqs, num_heads)
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        cu_seqlens_q,
        context_lens,
        block_tables,
        scale,
        q.stride(0),
        block_tables.stride(0),
        window,
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_m,
        PRECISION=precision(q),
        num_warps=4,
        num_stages=2,
    )
    return out


def prefill(
    q, k_cache, v_cache, meta, scale: float, window: int | None
) -> torch.Tensor:
    cu_seqlens, max_seqlen = meta.cu_seqlens_q, meta.max_seqlen_q
    lens, tables = meta.context_lens, meta.block_tables
    args = (cu_seqlens, lens, tables, max_seqlen, scale, window or 0)
    return prefill_paged(q, k_cache, v_cache, *args)
