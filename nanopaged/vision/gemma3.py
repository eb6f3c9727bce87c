"""Gemma 3 with images (`Gemma3ForConditionalGeneration`): a SigLIP vision tower over
the image resized to its square, a projector that pools its patches to
`mm_tokens_per_image` tokens (256 in the published models), and Gemma 3's language
model (`models/gemma3.py`, the core's decoder with Gemma's differences).

Unlike Qwen's, an image's tokens see each other both ways: in every layer each of them
attends to all of its image's tokens, the later ones too (the text stays causal; a
sliding layer's window still holds). So an image's tokens are never split over two
chunks of a prefill (its `Sequence.spans`), and a step that holds one attends through
`SpanAttention`, plain PyTorch over the paged cache with that mask.
"""

import torch
import torch.nn.functional as F
from torch import nn

from nanopaged.core.attention import Attention, attend, gather_blocks
from nanopaged.core.layers import Kernels
from nanopaged.core.sequence import cdiv
from nanopaged.models.gemma3 import Gemma3Layer, GemmaRMSNorm, gemma_rms_norm
from nanopaged.vision.model import VisionLanguageModel


class SiglipLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        dim, eps = config.hidden_size, config.layer_norm_eps
        self.num_heads = config.num_attention_heads
        self.layer_norm1 = nn.LayerNorm(dim, eps=eps)
        self.layer_norm2 = nn.LayerNorm(dim, eps=eps)
        self.self_attn = nn.Module()
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            setattr(self.self_attn, name, nn.Linear(dim, dim))
        self.mlp = nn.Module()
        self.mlp.fc1 = nn.Linear(dim, config.intermediate_size)
        self.mlp.fc2 = nn.Linear(config.intermediate_size, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, N, C): each image's patches attend to each other, then the MLP."""
        attention, (batch, length, dim) = self.self_attn, x.shape
        h = self.layer_norm1(x)
        q, k, v = (
            getattr(attention, name)(h)
            .view(batch, length, self.num_heads, -1)
            .transpose(1, 2)
            for name in ("q_proj", "k_proj", "v_proj")
        )
        out = F.scaled_dot_product_attention(q, k, v, scale=q.shape[-1] ** -0.5)
        x = x + attention.out_proj(out.transpose(1, 2).reshape(batch, length, dim))
        h = F.gelu(self.mlp.fc1(self.layer_norm2(x)), approximate="tanh")
        return x + self.mlp.fc2(h)


class SiglipTower(nn.Module):
    """Images (B, 3, size, size) -> their patches' last hidden states (B, N, C)."""

    def __init__(self, config):
        super().__init__()
        patch, dim = config.patch_size, config.hidden_size
        self.embeddings = nn.Module()
        self.embeddings.patch_embedding = nn.Conv2d(
            config.num_channels, dim, patch, patch
        )
        num_patches = (config.image_size // patch) ** 2
        self.embeddings.position_embedding = nn.Embedding(num_patches, dim)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(
            SiglipLayer(config) for _ in range(config.num_hidden_layers)
        )
        self.post_layernorm = nn.LayerNorm(dim, eps=config.layer_norm_eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        embeddings = self.embeddings
        x = embeddings.patch_embedding(
            pixels.to(embeddings.patch_embedding.weight.dtype)
        )
        x = x.flatten(2).transpose(1, 2) + embeddings.position_embedding.weight
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


class Projector(nn.Module):
    """The patches pooled to the image's tokens, normalised, projected to the language
    model's width."""

    def __init__(self, config):
        super().__init__()
        vision = config.vision_config
        self.mm_input_projection_weight = nn.Parameter(
            torch.zeros(vision.hidden_size, config.text_config.hidden_size)
        )
        self.mm_soft_emb_norm = nn.Module()
        self.mm_soft_emb_norm.weight = nn.Parameter(torch.zeros(vision.hidden_size))
        self.eps = vision.layer_norm_eps
        self.side = vision.image_size // vision.patch_size
        self.kernel = self.side // int(config.mm_tokens_per_image**0.5)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        batch, _, dim = patches.shape
        grid = patches.transpose(1, 2).reshape(batch, dim, self.side, self.side)
        pooled = F.avg_pool2d(grid.contiguous(), self.kernel, self.kernel)
        pooled = pooled.flatten(2).transpose(1, 2)
        normed = gemma_rms_norm(pooled, self.mm_soft_emb_norm.weight, self.eps)
        return torch.matmul(normed, self.mm_input_projection_weight).type_as(patches)


class SpanAttention(Attention):
    """A layer's attention that, in a step holding an image's tokens (`spans` set by
    the model: (T, 2), the first and last position each row sees besides its past),
    lets each of them see the rest of its image, over the paged cache."""

    spans: torch.Tensor | None = None

    def forward(self, q, k, v, meta):
        if self.spans is None:
            return super().forward(q, k, v, meta)
        store_kvcache = self.kernels[0]
        store_kvcache(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        bounds, block_size = meta.cu_seqlens_q.tolist(), self.k_cache.shape[1]
        for i, context in enumerate(meta.context_lens.tolist()):
            start, end = bounds[i], bounds[i + 1]
            blocks = meta.block_tables[i : i + 1, : cdiv(context, block_size)]
            keys = gather_blocks(self.k_cache, blocks)
            values = gather_blocks(self.v_cache, blocks)
            position = torch.arange(context - (end - start), context, device=q.device)
            position = position[:, None]
            key = torch.arange(keys.shape[2], device=q.device)[None, :]
            first, last = self.spans[start:end, :1], self.spans[start:end, 1:]
            mask = (key <= position) | ((key >= first) & (key <= last))
            if self.window:
                mask &= key > position - self.window
            queries = q[start:end].transpose(0, 1)[None]
            out[start:end] = attend(queries, keys, values, mask, self.scale)[
                0
            ].transpose(0, 1)
        return out


class Gemma3VL(VisionLanguageModel):
    """Gemma 3's language model (`language_model.`), its SigLIP tower
    (`vision_tower.`) and projector (`multi_modal_projector.`)."""

    text_architecture = "Gemma3ForCausalLM"
    decoder_layer = Gemma3Layer
    bidirectional_images = True

    def __init__(self, config, kernels: Kernels):
        super().__init__(config, kernels)
        text = config.get_text_config()
        self.model.norm = GemmaRMSNorm(text.hidden_size, text.rms_norm_eps, kernels)
        self.vision_tower = SiglipTower(config.vision_config)
        self.multi_modal_projector = Projector(config)
        for layer in self.model.layers:
            attention = layer.self_attn
            inner = attention.attn
            attention.attn = SpanAttention(
                attention.head_dim, kernels, inner.scale, inner.window
            )

    def first_layer_inputs(self, embeds: torch.Tensor, vision):
        """Gemma scales the text's embeddings, not the image's tokens that replace
        them: the stream starts as the first layer's residual (its input 0, as 0 + x
        is x), and every layer is told the step's spans."""
        scaled = embeds * self.model.layers[0].embed_scale
        if vision is not None and vision.embeds is not None:
            scaled[vision.rows] = vision.embeds.to(scaled.dtype)
        for layer in self.model.layers:
            layer.self_attn.attn.spans = None if vision is None else vision.spans
        return torch.zeros_like(scaled), scaled

    def vision_param(self, name: str) -> str:
        return name.replace("vision_tower.vision_model.", "vision_tower.")

    def checkpoint_param(self, name: str):
        # the published models' names of the language model
        return super().checkpoint_param(name.removeprefix("language_model."))

    def encode(self, images: list[dict]) -> list[torch.Tensor]:
        pixels = torch.cat([image["pixel_values"] for image in images]).to(self.device)
        return list(self.multi_modal_projector(self.vision_tower(pixels)))
