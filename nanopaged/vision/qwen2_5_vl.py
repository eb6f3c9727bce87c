"""Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`): a vision transformer over an
image's 14x14 patches, whose merger turns each 2x2 of patches into one token of the
language model; the language model is Qwen2's, the core's decoder, with multimodal RoPE.

The vision tower, in plain PyTorch as transformers computes it: the patches embedded by
a 3-D convolution (two frames of a patch: an image is its own second frame), rotary
embeddings of each patch's (row, column), blocks that attend within windows of 112x112
pixels but for a few (`fullatt_block_indexes`) that attend over the whole image, and the
merger. The patches come in the image processor's order, 2x2 groups together; the tower
reorders them window by window and back.
"""

import torch
import torch.nn.functional as F
from torch import nn

from nanopaged.core.layers import Kernels
from nanopaged.vision.model import VisionLanguageModel


class VisionRMSNorm(nn.Module):
    """RMSNorm in float32, then scaled in the input's dtype (transformers')."""

    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=True)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cu_seqlens: list[int], cos, sin):
        """x (N, C); attention within each segment of `cu_seqlens`, no mask."""
        q, k, v = self.qkv(x).reshape(len(x), 3, self.num_heads, -1).unbind(1)
        q, k = (
            ((t.float() * cos) + (rotate_half(t.float()) * sin)).to(t.dtype)
            for t in (q, k)
        )
        scale = q.shape[-1] ** -0.5
        out = torch.cat(
            [
                F.scaled_dot_product_attention(
                    *(t[a:b].transpose(0, 1)[None] for t in (q, k, v)), scale=scale
                )[0].transpose(0, 1)
                for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:])
            ]
        )
        return self.proj(out.reshape(len(x), -1))


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden)
        self.up_proj = nn.Linear(dim, hidden)
        self.down_proj = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.norm1 = VisionRMSNorm(config.hidden_size)
        self.norm2 = VisionRMSNorm(config.hidden_size)
        self.attn = VisionAttention(config.hidden_size, config.num_heads)
        self.mlp = VisionMLP(config.hidden_size, config.intermediate_size)

    def forward(self, x, cu_seqlens, cos, sin):
        x = x + self.attn(self.norm1(x), cu_seqlens, cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, dim: int, context_dim: int, merge: int):
        super().__init__()
        self.hidden_size = context_dim * merge * merge
        self.ln_q = VisionRMSNorm(context_dim)
        self.mlp = nn.Sequential(
            nn.Linear(self.hidden_size, self.hidden_size),
            nn.GELU(),
            nn.Linear(self.hidden_size, dim),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.hidden_size))


class VisionTower(nn.Module):
    """Patches of one or more images -> their tokens for the language model."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.merge = config.spatial_merge_size
        self.patch_embed = nn.Module()
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.patch_embed.proj = nn.Conv3d(
            config.in_channels, config.hidden_size, kernel, kernel, bias=False
        )
        head_dim = config.hidden_size // config.num_heads
        quarter = torch.arange(0, head_dim // 2, 2, dtype=torch.float) / (head_dim // 2)
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 1e4)
        self.register_buffer("inv_freq", 1.0 / theta**quarter, persistent=False)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(
            config.out_hidden_size, config.hidden_size, config.spatial_merge_size
        )

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]):
        """pixels (patches, C * t * p * p), grids (t, h, w) of patches per image -> the
        images' tokens, one after another (patches / merge^2, out_hidden_size)."""
        config, merge = self.config, self.merge
        conv = self.patch_embed.proj
        x = pixels.to(conv.weight.dtype).view(-1, conv.in_channels, *conv.kernel_size)
        x = conv(x).view(len(pixels), -1)
        order, windows = window_order(
            grids, merge, config.window_size // config.patch_size
        )
        unit = merge * merge
        x = x.view(-1, unit, x.shape[-1])[order].view(len(pixels), -1)
        angles = patch_positions(grids, merge).to(x.device)[..., None] * self.inv_freq
        angles = angles.flatten(1)  # (N, head_dim / 2): the row's, then the column's
        angles = angles.view(-1, unit, angles.shape[-1])[order].view(len(x), -1)
        angles = torch.cat((angles, angles), dim=-1)[:, None]  # (N, 1, head_dim)
        cos, sin = angles.cos(), angles.sin()
        whole = _cumulative([h * w for t, h, w in grids for _ in range(t)])
        for i, block in enumerate(self.blocks):
            full = i in config.fullatt_block_indexes
            x = block(x, whole if full else windows, cos, sin)
        return self.merger(x)[torch.argsort(order)]


def patch_positions(grids, merge: int) -> torch.Tensor:
    """Each patch's (row, column) in its image, in the processor's order (merge x merge
    groups of patches together): (N, 2)."""
    found = []
    for t, h, w in grids:
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        shape = (h // merge, merge, w // merge, merge)
        rows = rows.reshape(shape).transpose(1, 2).flatten()
        cols = cols.reshape(shape).transpose(1, 2).flatten()
        found.append(torch.stack((rows, cols), dim=-1).repeat(t, 1))
    return torch.cat(found)


def window_order(grids, merge: int, window: int) -> tuple[torch.Tensor, list[int]]:
    """The merged tokens' order window by window (windows of `window` patches a side,
    cut from each image's top left), and where each window starts among the patches."""
    side = window // merge  # merged tokens a window's side
    order, starts, first = [], [0], 0
    for t, h, w in grids:
        llm_h, llm_w = h // merge, w // merge
        index = torch.arange(t * llm_h * llm_w).reshape(t, llm_h, llm_w)
        for frame in index:
            for top in range(0, llm_h, side):
                for left in range(0, llm_w, side):
                    tokens = frame[top : top + side, left : left + side].flatten()
                    order.append(tokens + first)
                    starts.append(starts[-1] + len(tokens) * merge * merge)
        first += t * llm_h * llm_w
    return torch.cat(order), starts


def _cumulative(lengths: list[int]) -> list[int]:
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    return starts


class Qwen2_5_VL(VisionLanguageModel):
    """The language model (Qwen2's decoder with multimodal RoPE) and the vision tower
    (`visual`): `encode` makes the images' tokens."""

    text_architecture = "Qwen2ForCausalLM"
    mrope_layout = "sections"
    tower = VisionTower

    def __init__(self, config, kernels: Kernels):
        super().__init__(config, kernels)
        self.visual = self.tower(config.vision_config)

    def encode(self, images: list[dict]) -> list[torch.Tensor]:
        """Each image's tokens (its processor's `pixel_values` and `image_grid_thw`)."""
        grids = [tuple(image["image_grid_thw"][0].tolist()) for image in images]
        pixels = torch.cat([image["pixel_values"] for image in images])
        tokens = self.visual(pixels.to(self.device), grids)
        sizes = [t * h * w // self.visual.merge**2 for t, h, w in grids]
        return list(tokens.split(sizes))
