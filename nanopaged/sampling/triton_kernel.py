"""The GPU backends' sampling kernel: `sampler.sample` (the first token whose cumulative
probability under softmax(logits / T) exceeds the row's number) in two reads of each
row, its max and sum first, then its running sum up to the number, where PyTorch's ops
make about nine passes over float32 copies of the logits; a row that is no
distribution takes its greedy token, as there (`sampler.first_argmax`). `features.py`
enters it as the "triton" and "flash" backends' kernel in `sampler.SAMPLING_KERNELS`;
without this file they sample with `sampler.sample`."""

import torch
import triton  # without it, `features.add_features` skips this file
import triton.language as tl

BLOCK = 4096  # vocabulary entries a program reads at once


@triton.jit
def _sample_row(
    logits_ptr,
    row_stride,
    temperatures_ptr,
    uniform_ptr,
    out_ptr,
    vocab_size,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    logits_ptr += row.to(tl.int64) * row_stride
    temperature = tl.load(temperatures_ptr + row)
    index = tl.arange(0, BLOCK)
    # the max (a NaN counting as +inf), its first token, and the sum of
    # exp((x - max) / T), the sum rescaled as the max grows
    peak = tl.full([], float("-inf"), tl.float32)
    first_peak = tl.full([], 0, tl.int32)
    total = tl.full([], 0.0, tl.float32)
    for start in range(0, vocab_size, BLOCK):
        x = tl.load(
            logits_ptr + start + index,
            mask=start + index < vocab_size,
            other=float("-inf"),
        ).to(tl.float32)
        x = tl.where(x != x, float("inf"), x)
        block_peak = tl.max(x)
        block_first = tl.min(tl.where(x == block_peak, start + index, vocab_size))
        first_peak = tl.where(block_peak > peak, block_first, first_peak)
        new_peak = tl.maximum(peak, block_peak)
        base = tl.where(new_peak == float("-inf"), 0.0, new_peak)  # no -inf - -inf
        total = total * tl.exp((peak - base) / temperature) + tl.sum(
            tl.exp((x - base) / temperature)
        )
        peak = new_peak
    target = tl.load(uniform_ptr + row) * total
    # the first token whose running sum exceeds the target; never one of weight 0
    # (top-k, top-p, min-p dropped it): past the end by rounding, the last of weight > 0
    token = tl.full([], vocab_size, tl.int32)
    last = tl.full([], -1, tl.int32)
    running = tl.full([], 0.0, tl.float32)
    for start in range(0, vocab_size, BLOCK):
        inside = start + index < vocab_size
        x = tl.load(logits_ptr + start + index, mask=inside, other=float("-inf"))
        weight = tl.exp((x.to(tl.float32) - peak) / temperature)
        cumulative = running + tl.cumsum(weight, 0)
        hit = (cumulative > target) & (weight > 0) & inside
        token = tl.minimum(token, tl.min(tl.where(hit, start + index, vocab_size)))
        last = tl.maximum(last, tl.max(tl.where(weight > 0, start + index, -1)))
        running += tl.sum(weight)
    token = tl.where(token < vocab_size, token, last)
    # no distribution (every logit -inf, or a +inf): the greedy token, as `sample`'s
    finite = (peak > float("-inf")) & (peak < float("inf"))
    tl.store(out_ptr + row, tl.where(finite, token, first_peak).to(tl.int64))


def sample(
    logits: torch.Tensor, temperatures: torch.Tensor, uniform: torch.Tensor
) -> torch.Tensor:
    """`sampler.sample`: logits (R, V) of any float dtype, temperatures (R,) > 0 and
    uniform (R,) in [0, 1), float32 -> tokens (R,) int64."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    rows, vocab_size = logits.shape
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    _sample_row[(rows,)](
        logits,
        logits.stride(0),
        temperatures.float().contiguous(),
        uniform.float().contiguous(),
        tokens,
        vocab_size,
        BLOCK=BLOCK,
        num_warps=8,
    )
    return tokens
