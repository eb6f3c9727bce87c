"""Multimodal RoPE (Qwen2-VL's and its successors'): each token has three positions,
temporal, height and width, and each rotary frequency turns with one of them.

A text token's three positions are all its place in the text. An image's tokens take
their place in the image's grid of merged patches (t, h, w), each offset by the position
the image starts at, and the text after it resumes at that start plus the grid's longest
side: a prompt's positions end before its length when it holds images, and each token
generated after it takes its index plus that difference (`delta`).
"""

import numpy as np
import torch

from nanopaged.core.layers import Kernels, RotaryEmbedding


def prompt_positions(
    length: int, images: list[tuple[int, tuple[int, int, int]]]
) -> tuple[np.ndarray, int]:
    """The (3, length) positions of a prompt whose images are (first token, llm grid
    (t, h, w)), in order; and the delta of the tokens after it."""
    positions = np.empty((3, length), dtype=np.int64)
    text_start, position = 0, 0
    for start, (t, h, w) in images:
        text = np.arange(start - text_start) + position
        positions[:, text_start:start] = text
        position += start - text_start
        grid = np.indices((t, h, w)).reshape(3, -1) + position
        positions[:, start : start + t * h * w] = grid
        position += max(h, w)
        text_start = start + t * h * w
    positions[:, text_start:] = np.arange(length - text_start) + position
    return positions, int(positions.max(initial=-1)) + 1 - length


class MRotaryEmbedding(RotaryEmbedding):
    """The core's rotary embedding, its frequencies turned by the position `sources`
    names for each: its forward takes positions (3, T), or (T,) for text alone."""

    def __init__(
        self, head_dim, max_position, parameters: dict, kernels: Kernels, sources
    ):
        plain = {k: v for k, v in parameters.items() if k in ("rope_theta",)}
        super().__init__(head_dim, max_position, plain, kernels)
        self.register_buffer("sources", sources, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        if positions.dim() == 1:
            return super().forward(positions, q, k)
        half = self.cos_sin.shape[1] // 2
        index = positions[self.sources].T  # (T, half): each frequency's position
        cos = self.cos_sin[:, :half].gather(0, index)
        sin = self.cos_sin[:, half:].gather(0, index)
        table = torch.cat((cos, sin), dim=-1)  # (T, head_dim): a row per token
        rows = torch.arange(len(table), device=table.device)
        return self.rotary(q, k, rows, table)


def sources(sections: list[int], interleaved: bool) -> torch.Tensor:
    """Which of the three positions turns each frequency (of head_dim / 2), given the
    config's `mrope_section` (t, h, w): so many of the temporal, then height, then
    width position (Qwen2.5-VL); or, interleaved (Qwen3-VL), t h w t h w ..., each
    of h and w for its section's count, and t for the rest."""
    if not interleaved:
        return torch.repeat_interleave(torch.arange(3), torch.tensor(list(sections)))
    found = torch.zeros(sum(sections), dtype=torch.long)
    for axis in (1, 2):
        found[axis : 3 * sections[axis] : 3] = axis
    return found
