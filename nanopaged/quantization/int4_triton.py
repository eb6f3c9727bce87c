"""The 4-bit GEMM of AWQ and GPTQ layers on a GPU: the weight stays 4-bit in memory (a
quarter of float16's bytes, what a decode step reads) and is dequantized tile by tile
inside the matmul, as vLLM's and AutoAWQ's kernels do.

Whatever the checkpoint's packing, a layer keeps one layout here: `packed` int32 (in /
8, out), input 8w + i at bits 4i of word w (GPTQ's own), `zeros` uint8 and `scales`
float16, both (groups, out). A (BLOCK_K, BLOCK_N) tile of the weight is (value - zero) x
scale, computed in float32 (exact: the value the dequantized weight has), then cast to
the activations' dtype."""

import torch
import triton
import triton.language as tl
from torch import nn

from nanopaged.core.layers import LinearMethod

BLOCK_N = 64
BLOCK_K = 32


@triton.jit(do_not_specialize=["M"])  # a new batch size must not compile it again
def _int4_matmul_kernel(
    x_ptr,
    packed_ptr,
    zeros_ptr,
    scales_ptr,
    out_ptr,
    M,
    N,
    K,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One (BLOCK_M, BLOCK_N) tile of out = x (M, K) @ W (K, N), W read 4-bit."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for start in range(0, K, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        # (BM, BK)
        x = tl.load(
            x_ptr + rows[:, None] * K + ks[None, :],
            mask=(rows[:, None] < M) & (ks[None, :] < K),
            other=0.0,
        )
        inside = (ks[:, None] < K) & (cols[None, :] < N)
        words = tl.load(
            packed_ptr + (ks // 8)[:, None] * N + cols[None, :], mask=inside, other=0
        )
        values = (words >> ((ks % 8) * 4)[:, None]) & 0xF  # (BK, BN)
        group = (ks // GROUP)[:, None] * N + cols[None, :]
        zeros = tl.load(zeros_ptr + group, mask=inside, other=0).to(tl.int32)
        scales = tl.load(scales_ptr + group, mask=inside, other=0.0).to(tl.float32)
        w = ((values - zeros).to(tl.float32) * scales).to(x.dtype)
        acc += tl.dot(x, w, input_precision=PRECISION)
    tl.store(
        out_ptr + rows[:, None] * N + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=(rows[:, None] < M) & (cols[None, :] < N),
    )


def int4_matmul(
    x: torch.Tensor,
    packed: torch.Tensor,
    zeros: torch.Tensor,
    scales: torch.Tensor,
    group: int,
) -> torch.Tensor:
    """x (..., in) @ the 4-bit weight -> (..., out), in x's dtype."""
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    (m, k), n = flat.shape, packed.shape[1]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = 16 if m <= 16 else 64  # a decode step's few rows waste no tile
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, BLOCK_N))
    _int4_matmul_kernel[grid](
        flat,
        packed,
        zeros,
        scales,
        out,
        m,
        n,
        k,
        GROUP=group,
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
    )
    return out.view(*x.shape[:-1], n)


def pack_inputs(values: torch.Tensor) -> torch.Tensor:
    """values (in, out) in 0..15 -> int32 (in / 8, out), input 8w + i at bits 4i of word
    w."""
    shifts = torch.arange(0, 32, 4, device=values.device)[:, None]
    words = (values.view(-1, 8, values.shape[1]).to(torch.int64) << shifts).sum(dim=1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


class Int4Kernel(LinearMethod):
    """A layer's weight kept 4-bit (`keep`), multiplied by `int4_matmul`."""

    def __init__(self, group: int):
        self.group = group

    @classmethod
    def keep(
        cls,
        layer: nn.Module,
        values: torch.Tensor,
        zeros: torch.Tensor,
        scales: torch.Tensor,
        group: int,
    ) -> "Int4Kernel":
        """Keeps the 4-bit parts in `layer`; returns the method that multiplies them."""
        layer.packed = pack_inputs(values)
        layer.zeros = zeros.to(torch.uint8).contiguous()
        layer.scales = scales.to(torch.float16).contiguous()
        return cls(group)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        out = int4_matmul(x, layer.packed, layer.zeros, layer.scales, self.group)
        return out if layer.bias is None else out + layer.bias
