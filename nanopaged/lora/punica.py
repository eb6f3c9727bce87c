"""Each row's own adapter in one batched operation per projection: the punica / S-LoRA
idea.

A batch mixes rows of the base model and of several adapters. Adapter i changes a
projection W (out, in) into W + B_i A_i, with A_i (r, in) and B_i (out, r) of a small
rank r (B_i already multiplied by the adapter's scaling). Merging B_i A_i into W would
serve one adapter at a time; instead every adapter loaded in one of L *slots* keeps its
A and B stacked beside the others', and each row t carries its slot `slots[t]` (-1: the
base model). The delta of a whole batch is then two products whatever the mix of
adapters: shrink h_t = A_{slots[t]} x_t (r numbers a row), expand y_t += B_{slots[t]}
h_t.

A projection packing P parts (q/k/v: 3, gate/up: 2) gives each part its own A and B,
side by side in rank: a slot holds `a` (P*R, in) and `b` (out, P*R), R = max_lora_rank,
where part p's A fills ranks [p*R, p*R + r) and its B those columns of its own output
rows (zeros elsewhere).

On a GPU two Triton kernels gather each row's slot (punica's "BGMV": batched gather
matrix-vector), a program per row and tile, rows of the base model returning at once;
the slots are a tensor, so a CUDA graph captured once serves any mix. In torch (the CPU
path, and the reference) each adapter present gathers its rows and multiplies them by
its own A and B: a row never meets another slot's numbers (a NaN there stays there).
"""

import torch
import torch.nn.functional as F


def lora_delta_torch(y, x, a, b, slots: torch.Tensor) -> None:
    """y (T, out) += each row's adapter delta. x (T, in); a (L, PR, in); b (out, L, PR);
    slots (T,) int64 in [-1, L)."""
    for slot in slots.unique().tolist():
        if slot >= 0:
            rows = (slots == slot).nonzero().squeeze(1)
            y.index_add_(0, rows, F.linear(F.linear(x[rows], a[slot]), b[:, slot]))


def lora_delta_reference(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """The definition, a row at a time (for tests)."""
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            y[t] += (b[:, slot].float() @ (a[slot].float() @ x[t].float())).to(y.dtype)


def lora_delta_triton(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """`lora_delta_torch` by the two kernels of `punica_triton.py`."""
    from nanopaged.lora.punica_triton import expand, shrink

    expand(y, shrink(x.contiguous(), a, slots), b, slots)
