"""Triton kernels of decode attention over the paged KV cache: each sequence's context
split in slices attended in parallel, then reduced (see `decode_paged`).
"""

import torch
import triton
import triton.language as tl

from nanopaged.core.triton_attention import attend_tile, kv_tiles, precision


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
        # (G, D)
        q = tl.load(
            q_ptr + seq * q_stride + heads[:, None] * HEAD_DIM + dims[None, :],
            mask=row_mask,
            other=0.0,
        )
        m = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
        l_sum = tl.zeros((GROUP_PAD,), tl.float32)
        acc = tl.zeros((GROUP_PAD, HEAD_DIM), tl.float32)
        block_table_ptr = block_tables_ptr + seq * block_table_stride
        for tile in range(tl.maximum(start, first), end, BLOCK_N):
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
            m, l_sum, acc = attend_tile(
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
        PRECISION=precision(q),
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


def decode(q, k_cache, v_cache, meta, scale, window=None) -> torch.Tensor:
    lens, tables = meta.context_lens, meta.block_tables
    args = (tables, lens, meta.max_seqlen_k, scale)
    return decode_paged(q, k_cache, v_cache, *args, window=window or 0)
