"""Qwen3-VL (`Qwen3VLForConditionalGeneration`): Qwen2.5-VL's way of cutting an image
into 2x2 groups of patches, with three changes to the vision tower and one to the
language model.

The tower: every block attends over the whole image (no windows); the patches get a
learned position embedding besides their rotary one, a square table resampled
(bilinear, corners aligned) to the image's grid of patches; and its norms and MLP are
the plain LayerNorm and GELU ones. DeepStack: a few blocks' outputs
(`deepstack_visual_indexes`) go through their own mergers, and the language model's
first layers add them to the image's rows, one per layer. The language model is
Qwen3's, the core's decoder, with multimodal RoPE interleaved (t h w t h w ...).
"""

import torch
import torch.nn.functional as F
from torch import nn

from nanopaged.vision.qwen2_5_vl import Qwen2_5_VL, VisionAttention, patch_positions


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.linear_fc1 = nn.Linear(dim, hidden)
        self.linear_fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate="tanh"))


class VisionBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.attn = VisionAttention(config.hidden_size, config.num_heads)
        self.mlp = VisionMLP(config.hidden_size, config.intermediate_size)

    def forward(self, x, cu_seqlens, cos, sin):
        x = x + self.attn(self.norm1(x), cu_seqlens, cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Each 2x2 group of patches -> one token; normalised before the groups are joined,
    or after them (`after`: DeepStack's mergers)."""

    def __init__(self, config, after: bool = False):
        super().__init__()
        self.width = config.hidden_size * config.spatial_merge_size**2
        self.after = after
        self.norm = nn.LayerNorm(self.width if after else config.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.width, self.width)
        self.linear_fc2 = nn.Linear(self.width, config.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.width)) if self.after else self.norm(x)
        return self.linear_fc2(F.gelu(self.linear_fc1(x.view(-1, self.width))))


class VisionTower(nn.Module):
    """Patches of one or more images -> their tokens for the language model, each
    followed by its DeepStack tokens: (tokens, out_hidden_size * (1 + levels))."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.merge = config.spatial_merge_size
        self.patch_embed = nn.Module()
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.patch_embed.proj = nn.Conv3d(
            config.in_channels, config.hidden_size, kernel, kernel
        )
        self.pos_embed = nn.Embedding(
            config.num_position_embeddings, config.hidden_size
        )
        head_dim = config.hidden_size // config.num_heads
        quarter = torch.arange(0, head_dim // 2, 2, dtype=torch.float) / (head_dim // 2)
        theta = config.rope_parameters["rope_theta"]
        self.register_buffer("inv_freq", 1.0 / theta**quarter, persistent=False)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config)
        self.deepstack_merger_list = nn.ModuleList(
            PatchMerger(config, after=True) for _ in config.deepstack_visual_indexes
        )

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]):
        conv = self.patch_embed.proj
        x = pixels.to(conv.weight.dtype).view(-1, conv.in_channels, *conv.kernel_size)
        x = conv(x).view(len(pixels), -1)
        where = patch_positions(grids, self.merge).to(x.device)
        x = x + self.grid_embeddings(grids, where).to(x.dtype)
        angles = (where[..., None] * self.inv_freq).flatten(1)  # row's, then column's
        angles = torch.cat((angles, angles), dim=-1)[:, None]  # (N, 1, head_dim)
        cos, sin = angles.cos(), angles.sin()
        starts = [0]
        for t, h, w in grids:
            starts += [starts[-1] + h * w * (i + 1) for i in range(t)]
        stacked = []
        for i, block in enumerate(self.blocks):
            x = block(x, starts, cos, sin)
            if i in self.config.deepstack_visual_indexes:
                level = self.config.deepstack_visual_indexes.index(i)
                stacked.append(self.deepstack_merger_list[level](x))
        return torch.cat([self.merger(x), *stacked], dim=-1)

    def grid_embeddings(self, grids, where: torch.Tensor) -> torch.Tensor:
        """The learned position table resampled to each image's grid, per patch."""
        side = int(self.pos_embed.num_embeddings**0.5)
        table = self.pos_embed.weight.T.reshape(1, -1, side, side)
        found, first = [], 0
        for t, h, w in grids:
            grid = F.interpolate(table, (h, w), mode="bilinear", align_corners=True)[0]
            rows, cols = where[first : first + t * h * w].unbind(-1)
            found.append(grid[:, rows, cols].T)
            first += t * h * w
        return torch.cat(found)


class Qwen3VL(Qwen2_5_VL):
    """The language model (Qwen3's decoder with interleaved multimodal RoPE) and the
    vision tower (`visual`), whose images' tokens each carry their DeepStack ones beside
    them (see `VisionLanguageModel.deepstack`); the rest as Qwen2.5-VL's."""

    text_architecture = "Qwen3ForCausalLM"
    mrope_layout = "interleaved"
    tower = VisionTower
