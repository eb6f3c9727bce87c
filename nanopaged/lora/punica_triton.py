"""punica's BGMV kernels in Triton (see punica.py): a program per row and tile, each
gathering its row's adapter slot; a row of the base model (slot -1) does nothing."""

import torch
import triton
import triton.language as tl

BLOCK_K = 64
BLOCK_N = 64


@triton.jit(do_not_specialize=["K"])
def _shrink_kernel(
    x_ptr,
    a_ptr,
    h_ptr,
    slots_ptr,
    x_stride,
    K,
    PR: tl.constexpr,
    BLOCK_PR: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """h[t] (PR,) = a[slot] (PR, K) @ x[t] (K,), in float32."""
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t)
    if slot >= 0:
        ranks = tl.arange(0, BLOCK_PR)
        acc = tl.zeros((BLOCK_PR,), tl.float32)
        for start in range(0, K, BLOCK_K):
            ks = start + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + t * x_stride + ks, mask=ks < K, other=0.0).to(
                tl.float32
            )
            a = tl.load(
                a_ptr + (slot * PR + ranks[:, None]) * K + ks[None, :],
                mask=(ranks[:, None] < PR) & (ks[None, :] < K),
                other=0.0,
            )
            acc += tl.sum(a.to(tl.float32) * x[None, :], axis=1)
        tl.store(h_ptr + t * PR + ranks, acc, mask=ranks < PR)


@triton.jit(do_not_specialize=["N"])
def _expand_kernel(
    h_ptr,
    b_ptr,
    y_ptr,
    slots_ptr,
    y_stride,
    N,
    L: tl.constexpr,
    PR: tl.constexpr,
    BLOCK_PR: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """y[t, cols] += b[cols, slot] (BLOCK_N, PR) @ h[t] (PR,)."""
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t)
    if slot >= 0:
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        ranks = tl.arange(0, BLOCK_PR)
        h = tl.load(h_ptr + t * PR + ranks, mask=ranks < PR, other=0.0)
        b = tl.load(
            b_ptr + cols[:, None] * (L * PR) + slot * PR + ranks[None, :],
            mask=(cols[:, None] < N) & (ranks[None, :] < PR),
            other=0.0,
        )
        delta = tl.sum(b.to(tl.float32) * h[None, :], axis=1)
        y = tl.load(y_ptr + t * y_stride + cols, mask=cols < N, other=0.0)
        tl.store(
            y_ptr + t * y_stride + cols,
            (y.to(tl.float32) + delta).to(y.dtype),
            mask=cols < N,
        )


def shrink(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """x (T, K), a (L, PR, K) -> h (T, PR) float32 (rows of the base model left
    unwritten)."""
    num_tokens, rank = x.shape[0], a.shape[1]
    h = torch.empty(num_tokens, rank, dtype=torch.float32, device=x.device)
    _shrink_kernel[(num_tokens,)](
        x,
        a,
        h,
        slots,
        x.stride(0),
        x.shape[1],
        PR=rank,
        BLOCK_PR=triton.next_power_of_2(rank),
        BLOCK_K=BLOCK_K,
    )
    return h


def expand(
    y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, slots: torch.Tensor
) -> None:
    """y (T, N) += b (N, L, PR) gathered at each row's slot @ h (T, PR)."""
    num_tokens, n = y.shape
    grid = (num_tokens, triton.cdiv(n, BLOCK_N))
    _expand_kernel[grid](
        h,
        b,
        y,
        slots,
        y.stride(0),
        n,
        L=b.shape[1],
        PR=b.shape[2],
        BLOCK_PR=triton.next_power_of_2(b.shape[2]),
        BLOCK_N=BLOCK_N,
    )
