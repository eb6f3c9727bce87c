"""Gemma 3 (text, `Gemma3ForCausalLM`): the core's decoder with Gemma's differences.

Its layers interleave sliding-window attention (`layer_types`, `sliding_window`) with
full attention, each kind with its own RoPE parameters (a local base; a global base,
maybe with linear scaling): the core reads both from the config. Besides: the embedding
is scaled by sqrt(hidden_size); every norm scales by 1 + weight, in float32; q and k are
normalised per head; scores are scaled by query_pre_attn_scalar ** -0.5 rather than
head_dim ** -0.5; each block's output is normalised again before it joins the residual
stream, and the MLP's input too; the MLP's activation is GELU (tanh); the LM head is the
embedding.
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from nanopaged.checks import unsupported_fields
from nanopaged.core.attention import AttentionMetadata
from nanopaged.core.layers import Kernels, RMSNorm, compiled_on_gpu
from nanopaged.core.model import (
    MLP,
    CausalLM,
    DecoderAttention,
    DecoderLayer,
)


@compiled_on_gpu
def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * (1.0 + weight.float())).to(x.dtype)


class GemmaRMSNorm(RMSNorm):
    """The core's RMSNorm, but scaled by 1 + weight in float32 (Gemma stores the
    offset)."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return gemma_rms_norm(x, self.weight, self.eps)
        x = x + residual
        return gemma_rms_norm(x, self.weight, self.eps), x


@compiled_on_gpu
def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


class GeluMLP(MLP):
    def __init__(self, config: PretrainedConfig, kernels: Kernels):
        super().__init__(config, kernels)
        self.act = gelu_tanh_and_mul


class Gemma3Attention(DecoderAttention):
    def __init__(self, config: PretrainedConfig, kernels: Kernels, index: int):
        super().__init__(config, kernels, index)
        self.qk_norm = True
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps, kernels)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps, kernels)
        self.attn.scale = config.query_pre_attn_scalar**-0.5


class Gemma3Layer(DecoderLayer):
    attention = Gemma3Attention

    def __init__(self, config: PretrainedConfig, kernels: Kernels, index: int):
        super().__init__(config, kernels, index)
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps, kernels)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps, kernels)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps, kernels)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps, kernels)
        # sqrt(hidden_size) rounded to the model's dtype, as transformers multiplies by
        # it
        self.embed_scale = torch.tensor(size**0.5).to(torch.get_default_dtype()).item()

    def make_mlp(
        self, config: PretrainedConfig, kernels: Kernels, index: int
    ) -> nn.Module:
        return GeluMLP(config, kernels)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's output, the residual stream before it), as the core's layer."""
        residual = hidden * self.embed_scale if residual is None else hidden + residual
        attended = self.self_attn(positions, self.input_layernorm(residual), meta)
        residual = residual + self.post_attention_layernorm(attended)
        hidden = self.mlp(self.pre_feedforward_layernorm(residual))
        return self.post_feedforward_layernorm(hidden), residual


def unsupported_gemma3_fields(config: PretrainedConfig) -> dict:
    """The core's checks, and Gemma's own options that change the model."""
    act = config.hidden_activation
    found = {
        "hidden_activation": act if act != "gelu_pytorch_tanh" else None,
        "final_logit_softcapping": config.final_logit_softcapping,
        "attn_logit_softcapping": config.attn_logit_softcapping,
        "use_bidirectional_attention": config.use_bidirectional_attention or None,
    }
    return unsupported_fields(config) | {
        k: v for k, v in found.items() if v is not None
    }


class Gemma3ForCausalLM(CausalLM):
    decoder_layer = Gemma3Layer

    def __init__(self, config: PretrainedConfig, kernels: Kernels):
        super().__init__(config, kernels)
        self.model.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
