"""The experts of a mixture-of-experts layer in two Triton launches, as vLLM's
`fused_moe`.

Each token picks `top_k` experts, so the layer is T * top_k (token, expert) *pairs*. The
pairs are sorted by expert and each expert's run padded to a multiple of BLOCK_M rows,
so that every BLOCK_M-row tile of the sorted list belongs to one expert: one program
multiplies a tile by its expert's weights. Both the sort and the kernels keep static
shapes (no count leaves the GPU), so a decode step's experts can be captured in a CUDA
graph. Checked against the plain-PyTorch experts of `moe.py` (under TRITON_INTERPRET=1
on CPU).
"""

import torch
import triton
import triton.language as tl

from nanopaged.core import layers

silu_and_mul = layers.compiled_on_gpu(layers.silu_and_mul)


def align_by_expert(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids (T, K) -> (pair index of each sorted row, padding rows holding T*K; the
    expert of each BLOCK_M tile; the number of rows in use, as a (1,) tensor)."""
    pairs = topk_ids.flatten()
    num_pairs = pairs.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=pairs.device)
    counts.scatter_add_(0, pairs, torch.ones_like(pairs))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = padded.cumsum(0)
    order = pairs.argsort(stable=True)  # pair indices, grouped by expert
    rank = (
        torch.arange(num_pairs, device=pairs.device)
        - (counts.cumsum(0) - counts)[pairs[order]]
    )
    max_rows = num_pairs + num_experts * (block_m - 1)
    max_rows = (max_rows + block_m - 1) // block_m * block_m
    sorted_ids = torch.full(
        (max_rows,), num_pairs, dtype=torch.int64, device=pairs.device
    )
    sorted_ids[(padded_ends - padded)[pairs[order]] + rank] = order
    tile_starts = torch.arange(0, max_rows, block_m, device=pairs.device)
    tile_experts = torch.searchsorted(padded_ends, tile_starts, right=True)
    return sorted_ids, tile_experts.clamp(max=num_experts - 1), padded_ends[-1:]


@triton.jit(do_not_specialize=["num_pairs"])
def _grouped_matmul_kernel(
    a_ptr,
    w_ptr,
    out_ptr,
    weights_ptr,
    sorted_ids_ptr,
    tile_experts_ptr,
    rows_in_use_ptr,
    num_pairs,
    N: tl.constexpr,
    K: tl.constexpr,
    A_ROWS_PER_PAIR: tl.constexpr,
    MUL_WEIGHTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One program: a BLOCK_M tile of sorted pairs times a BLOCK_N slice of the output
    features of the tile's expert. Row r of `a` is pair r's input (or token r //
    top_k's, when A_ROWS_PER_PAIR is top_k); `w` is (E, N, K); the product, scaled by
    the pair's routing weight when MUL_WEIGHTS, goes to row `pair` of `out` (T*K, N)."""
    tile, n_tile = tl.program_id(0), tl.program_id(1)
    if tile * BLOCK_M < tl.load(rows_in_use_ptr):
        pairs = tl.load(sorted_ids_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = pairs < num_pairs
        expert = tl.load(tile_experts_ptr + tile).to(tl.int64)
        cols = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        a_rows = a_ptr + (pairs // A_ROWS_PER_PAIR)[:, None] * K
        w_cols = w_ptr + expert * N * K + cols[None, :] * K
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k in range(0, K, BLOCK_K):
            ks = k + tl.arange(0, BLOCK_K)
            a = tl.load(
                a_rows + ks[None, :], mask=valid[:, None] & (ks[None, :] < K), other=0.0
            )
            w = tl.load(
                w_cols + ks[:, None],
                mask=(cols[None, :] < N) & (ks[:, None] < K),
                other=0.0,
            )
            acc += tl.dot(a, w, input_precision=PRECISION)
        if MUL_WEIGHTS:
            acc *= tl.load(weights_ptr + pairs, mask=valid, other=0.0)[:, None]
        tl.store(
            out_ptr + pairs[:, None] * N + cols[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=valid[:, None] & (cols[None, :] < N),
        )


def _grouped_matmul(
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    aligned: tuple,
    weights: torch.Tensor,
    a_rows_per_pair: int,
    block_m: int,
) -> None:
    sorted_ids, tile_experts, rows_in_use = aligned
    n, k = w.shape[1], w.shape[2]
    block_n, block_k = 64, 32
    grid = (tile_experts.numel(), triton.cdiv(n, block_n))
    _grouped_matmul_kernel[grid](
        a,
        w,
        out,
        weights,
        sorted_ids,
        tile_experts,
        rows_in_use,
        out.shape[0],
        N=n,
        K=k,
        A_ROWS_PER_PAIR=a_rows_per_pair,
        MUL_WEIGHTS=a_rows_per_pair == 1,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=4,
    )


def fused_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """x (T, H) through experts `gate_up` (E, 2I, H) and `down` (E, H, I): the sum over
    each token's top_k experts (`topk_ids` (T, K)) of its routing weight times the
    expert's SwiGLU."""
    num_tokens, top_k = topk_ids.shape
    num_experts = gate_up.shape[0]
    # small tiles waste less padding when each expert gets few pairs (decode)
    block_m = 16 if num_tokens * top_k <= 4 * num_experts * 16 else 64
    aligned = align_by_expert(topk_ids, num_experts, block_m)
    x, weights = x.contiguous(), topk_weights.flatten().float().contiguous()
    gate_up_out = x.new_empty(num_tokens * top_k, gate_up.shape[1])
    _grouped_matmul(x, gate_up, gate_up_out, aligned, weights, top_k, block_m)
    hidden = silu_and_mul(gate_up_out).contiguous()
    down_out = x.new_empty(num_tokens * top_k, down.shape[1])
    _grouped_matmul(hidden, down, down_out, aligned, weights, 1, block_m)
    return down_out.view(num_tokens, top_k, -1).sum(dim=1)
