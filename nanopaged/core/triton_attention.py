"""Triton kernels for the paged KV cache: store new K/V, decode attention, prefill
attention.

Each kernel finds a token's K/V through the block table, so any block size works, and
each is checked against the plain-PyTorch functions of `attention.py` (under
TRITON_INTERPRET=1 on CPU). `prefill` and `decode` are the backend as `attention.py`
calls it (with a step's metadata); the kernels themselves take plain tensors.
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
def _kv_tiles(
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
def _attend_tile(q, k, v, mask, m, l_sum, acc, scale, PRECISION: tl.constexpr):
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


@triton.jit(do_not_specialize=["block_table_stride", "num_splits", "window"])
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,
    partial_ptr,
    lse_ptr,
    scale,
    q_stride,
    block_table_stride,
    window,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    num_splits,
    SPLIT_LEN: tl.constexpr,
    DIRECT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One program: one sequence, one KV head with all the query heads that share it
    (read once for the whole group), and the SPLIT_LEN-token slice `split` of the
    context. With several splits (not DIRECT) it writes a partial result and its
    log-sum-exp for the reduce kernel. With a sliding `window` (0: none), the keys
    before it are neither read nor attended, and the splits wholly before it do nothing.
    Softmax runs in base 2 (exp2 is cheaper): the scores are scaled by log2(e) =
    1.4427."""
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    first = tl.where(window > 0, tl.maximum(context_len - window, 0), 0)
    start = split * SPLIT_LEN
    if (start < context_len and start + SPLIT_LEN > first) or DIRECT:
        end = tl.minimum(start + SPLIT_LEN, context_len)
        group = tl.arange(0, GROUP_PAD)
        dims = tl.arange(0, HEAD_DIM)
        heads = kv_head * GROUP + group
        row_mask = (group < GROUP)[:, None]
        q = tl.load(
            q_ptr + seq * q_stride + heads[:, None] * HEAD_DIM + dims[None, :],
            mask=row_mask,
            other=0.0,
        )  # (G, D)
        m = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
        l_sum = tl.zeros((GROUP_PAD,), tl.float32)
        acc = tl.zeros((GROUP_PAD, HEAD_DIM), tl.float32)
        block_table_ptr = block_tables_ptr + seq * block_table_stride
        for tile in range(tl.maximum(start, first), end, BLOCK_N):
            pos = tile + tl.arange(0, BLOCK_N)
            valid = pos < end
            k, v = _kv_tiles(
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
            m, l_sum, acc = _attend_tile(
                q, k, v, valid[None, :], m, l_sum, acc, scale, PRECISION
            )
        has_keys = l_sum > 0  # false only for a padding row (context 0)
        l_sum = tl.where(has_keys, l_sum, 1.0)
        out = acc / l_sum[:, None]
        if DIRECT:
            tl.store(
                out_ptr + seq * q_stride + heads[:, None] * HEAD_DIM + dims[None, :],
                out.to(out_ptr.dtype.element_ty),
                mask=row_mask,
            )
        else:
            row = (seq * NUM_KV_HEADS * GROUP + heads) * num_splits + split  # (G,)
            tl.store(
                partial_ptr + row[:, None] * HEAD_DIM + dims[None, :],
                out,
                mask=row_mask,
            )
            tl.store(lse_ptr + row, m + tl.log2(l_sum), mask=group < GROUP)


@triton.jit(do_not_specialize=["num_splits", "window"])
def _decode_reduce_kernel(
    partial_ptr,
    lse_ptr,
    out_ptr,
    context_lens_ptr,
    num_splits,
    window,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SPLIT_LEN: tl.constexpr,
):
    """Combines the splits of one (sequence, head) row, each weighted by its softmax
    mass.

    The splits that hold keys are folded in order, one at a time, so the result does not
    depend on how many empty splits the grid had: eager and CUDA-graph decode agree bit
    for bit."""
    row = tl.program_id(0)
    context_len = tl.load(context_lens_ptr + row // NUM_HEADS)
    num_active = tl.cdiv(context_len, SPLIT_LEN)
    first = tl.where(window > 0, tl.maximum(context_len - window, 0) // SPLIT_LEN, 0)
    dims = tl.arange(0, HEAD_DIM)
    m = tl.full((1,), float("-inf"), tl.float32)
    l_sum = tl.zeros((1,), tl.float32)
    acc = tl.zeros((HEAD_DIM,), tl.float32)
    for split in range(first, num_active):
        lse = tl.load(lse_ptr + row * num_splits + split + tl.zeros((1,), tl.int32))
        partial = tl.load(partial_ptr + (row * num_splits + split) * HEAD_DIM + dims)
        m_new = tl.maximum(m, lse)
        alpha = tl.exp2(m - m_new)
        weight = tl.exp2(lse - m_new)
        acc = acc * alpha + partial * weight
        l_sum = l_sum * alpha + weight
        m = m_new
    out = acc / tl.where(l_sum > 0, l_sum, 1.0)
    tl.store(out_ptr + row * HEAD_DIM + dims, out.to(out_ptr.dtype.element_ty))


def _precision(q: torch.Tensor) -> str:
    """float32 runs are compared token-for-token with transformers: no TF32 shortcuts
    there."""
    return "ieee" if q.dtype == torch.float32 else "tf32"


def split_len(batch_size: int, num_kv_heads: int, device: torch.device) -> int:
    """Tokens per context slice in decode: short enough that a small batch still fills
    the GPU about twice over, 64 at least.

    It depends on the batch size only through its next power of two, which is the same
    for a batch and the CUDA-graph size it is padded to: eager and graph decode split
    alike."""
    num_sms = 4
    if device.type == "cuda":
        num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    programs = triton.next_power_of_2(batch_size) * num_kv_heads
    return 64 * triton.next_power_of_2(triton.cdiv(programs, 2 * num_sms))


def decode_paged(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    max_seqlen_k: int,
    scale: float,
    split_tokens: int | None = None,
    window: int = 0,
) -> torch.Tensor:
    """q: (B, nh, hs), one query per sequence, over its cached context (split-K
    decoding), or over its last `window` tokens. The arguments are those of
    `attention.AttentionMetadata`."""
    batch_size, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    split_tokens = split_tokens or split_len(batch_size, num_kv_heads, q.device)
    num_splits = triton.cdiv(max_seqlen_k, split_tokens)
    q = q.contiguous()
    out = torch.empty_like(q)
    partial = lse = out  # unused with a single split
    if num_splits > 1:
        partial = torch.empty(
            batch_size,
            num_heads,
            num_splits,
            head_dim,
            dtype=torch.float32,
            device=q.device,
        )
        lse = torch.empty(
            batch_size, num_heads, num_splits, dtype=torch.float32, device=q.device
        )
    _decode_kernel[(batch_size, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        out,
        partial,
        lse,
        scale,
        q.stride(0),
        block_tables.stride(0),
        window,
        NUM_KV_HEADS=num_kv_heads,
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_N=64,
        num_splits=num_splits,
        SPLIT_LEN=split_tokens,
        DIRECT=num_splits == 1,
        PRECISION=_precision(q),
        num_warps=4,
        num_stages=2,
    )
    if num_splits > 1:
        _decode_reduce_kernel[(batch_size * num_heads,)](
            partial,
            lse,
            out,
            context_lens,
            num_splits,
            window,
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            SPLIT_LEN=split_tokens,
        )
    return out


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
            k, v = _kv_tiles(
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
            m, l_sum, acc = _attend_tile(
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
        PRECISION=_precision(q),
        num_warps=4,
        num_stages=2,
    )
    return out


def prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    return prefill_paged(
        q,
        k_cache,
        v_cache,
        meta.cu_seqlens_q,
        meta.context_lens,
        meta.block_tables,
        meta.max_seqlen_q,
        scale,
        window or 0,
    )


def decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    return decode_paged(
        q,
        k_cache,
        v_cache,
        meta.block_tables,
        meta.context_lens,
        meta.max_seqlen_k,
        scale,
        window=window or 0,
    )
