"""One decoder for Qwen3, Qwen2 and Llama checkpoints: Qwen3 normalises q and k per head
before the rotary embedding, Qwen2 has biases on the q/k/v projections. Other model families
stand above the core (`nanopaged/models/`) and enter `ARCHITECTURES` themselves."""
import torch
from torch import nn
from transformers import PretrainedConfig

from nanopaged.core.attention import Attention, AttentionMetadata
from nanopaged.core.layers import (MergedColumnParallelLinear, ParallelLMHead,
                                   QKVParallelLinear, RMSNorm, RotaryEmbedding,
                                   RowParallelLinear, VocabParallelEmbedding, silu_and_mul,
                                   tp_rank_and_size)


def rope_parameters(config: PretrainedConfig) -> dict:
    params = getattr(config, "rope_parameters", None)
    if params:
        return dict(params)
    return dict(getattr(config, "rope_scaling", None) or {}, rope_theta=config.rope_theta)


def check_supported(config: PretrainedConfig) -> None:
    """Raises ValueError naming an architecture, or a config field, that asks for something the
    model does not do, rather than run a silently different model."""
    architectures = getattr(config, "architectures", None) or []
    model = next((ARCHITECTURES[a] for a in architectures if a in ARCHITECTURES), None)
    if model is None:
        raise ValueError(f"unsupported architecture {architectures}; nanopaged supports "
                         f"{', '.join(ARCHITECTURES)}")
    for name, value in model.unsupported(config).items():
        shown = f"{name}={value!r}" if value not in (None, True) else name
        raise ValueError(f"the checkpoint's config has {shown}, which nanopaged does not "
                         f"implement")


def unsupported_fields(config: PretrainedConfig) -> dict:
    """The fields of a Qwen- or Llama-like config that ask for what this decoder does not do,
    with their values."""
    rope = rope_parameters(config)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    partial = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    layer_types = getattr(config, "layer_types", None) or []
    sliding = getattr(config, "use_sliding_window", False) or any(
        t != "full_attention" for t in layer_types)
    found = {"hidden_act": config.hidden_act if config.hidden_act != "silu" else None,
             "rope_type": rope_type if rope_type not in ("default", "llama3") else None,
             "partial_rotary_factor": partial if partial != 1.0 else None,
             "use_sliding_window / layer_types (sliding-window attention)": sliding or None,
             "quantization_config": getattr(config, "quantization_config", None)}
    return {name: value for name, value in found.items() if value is not None}


class DecoderAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, backend: str):
        super().__init__()
        _, tp_size = tp_rank_and_size()
        arch = config.architectures[0]
        self.head_dim = (getattr(config, "head_dim", None)
                         or config.hidden_size // config.num_attention_heads)
        self.num_heads = config.num_attention_heads // tp_size
        self.num_kv_heads = config.num_key_value_heads // tp_size
        qkv_bias = arch == "Qwen2ForCausalLM" or getattr(config, "attention_bias", False)
        o_bias = arch != "Qwen2ForCausalLM" and getattr(config, "attention_bias", False)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim,
                                          config.num_attention_heads, config.num_key_value_heads,
                                          bias=qkv_bias)
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim,
                                        config.hidden_size, bias=o_bias)
        self.qk_norm = arch == "Qwen3ForCausalLM"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(self.head_dim, config.max_position_embeddings,
                                          rope_parameters(config))
        self.attn = Attention(self.head_dim, backend)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(hidden).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)    # (T, nh, hs)
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # (T, nkv, hs)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v, meta)
        return self.o_proj(out.flatten(1))


class MLP(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [config.intermediate_size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, backend: str):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DecoderAttention(config, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's output, the residual stream before it): the next norm adds them,
        which fuses the residual add into the norm's kernel."""
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    def __init__(self, config: PretrainedConfig, backend: str):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, backend)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None  # (T, C)
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, meta)
        return self.norm(hidden, residual)[0]


class CausalLM(nn.Module):
    """The decoder plus the LM head; `forward` returns hidden states, `compute_logits` the
    logits of the rows that sample. `unsupported(config)` names what a checkpoint's config asks
    for that the model does not do; the loader fills the parameters through `packed_modules`."""
    unsupported = staticmethod(unsupported_fields)

    # checkpoint name fragment -> (packed parameter fragment, shard id)
    packed_modules = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: PretrainedConfig, backend: str):
        super().__init__()
        self.model = DecoderModel(config, backend)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.tie_word_embeddings = getattr(config, "tie_word_embeddings", False)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def kv_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        attn = self.model.layers[0].self_attn
        return 2 * len(self.model.layers) * block_size * attn.num_kv_heads * attn.head_dim \
            * dtype.itemsize

    def allocate_kv_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype,
                          device: torch.device) -> torch.Tensor:
        """One zeroed tensor (2, num_layers, num_blocks, block_size, nkv, hs) holding every
        layer's K and V cache; each layer's attention gets its views."""
        attn, layers = self.model.layers[0].self_attn, self.model.layers
        kv_cache = torch.zeros(2, len(layers), num_blocks, block_size, attn.num_kv_heads,
                               attn.head_dim, dtype=dtype, device=device)
        for i, layer in enumerate(layers):
            layer.self_attn.attn.k_cache = kv_cache[0, i]
            layer.self_attn.attn.v_cache = kv_cache[1, i]
        return kv_cache


# architecture name (a checkpoint's `architectures`) -> its model class
ARCHITECTURES: dict[str, type[nn.Module]] = dict.fromkeys(
    ("Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM"), CausalLM)
