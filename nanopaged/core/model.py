"""One decoder for Qwen3 (q and k normalised per head), Qwen2 (q/k/v biases) and Llama. Other
families stand above the core (`nanopaged/models/`): a `CausalLM` subclass with its own
`decoder_layer`, entered in `ARCHITECTURES` (and `QK_NORM` or `QKV_BIAS`) by its module."""
import torch
from torch import nn
from transformers import PretrainedConfig

from nanopaged.core.attention import BACKENDS, Attention, AttentionMetadata
from nanopaged.core.layers import (QUANTIZATIONS, MergedColumnParallelLinear, ParallelLMHead,
                                   QKVParallelLinear, RMSNorm, RotaryEmbedding,
                                   RowParallelLinear, VocabParallelEmbedding, silu_and_mul, tp_size)


def rope_parameters(config: PretrainedConfig, index: int = 0) -> dict:
    """Layer `index`'s RoPE parameters (transformers keys them by layer type where the types'
    differ, as Gemma 3's)."""
    params = getattr(config, "rope_parameters", None) or dict(
        getattr(config, "rope_scaling", None) or {}, rope_theta=config.rope_theta)
    types = getattr(config, "layer_types", None)
    return dict(params.get(types[index], params) if types else params)


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
        raise ValueError(f"the checkpoint's config has {shown}, which nanopaged does not implement")


ROPE_TYPES = {"default", "llama3", "linear"}
LAYER_TYPES = {"full_attention", "sliding_attention"}
QK_NORM = {"Qwen3ForCausalLM"}  # architectures whose q and k are normalised per head
QKV_BIAS = {"Qwen2ForCausalLM"}  # whose q/k/v projections have biases (and o's none)


def sliding_window(config: PretrainedConfig, index: int) -> int | None:
    """Layer `index`'s window: the config's `sliding_window`, on the layers its `layer_types`
    marks sliding (on every layer without `layer_types`, as Mistral's), or None."""
    types = getattr(config, "layer_types", None)
    slides = types is None or types[index] == "sliding_attention"
    return getattr(config, "sliding_window", None) if slides else None


def unsupported_fields(config: PretrainedConfig) -> dict:
    """The fields of a Qwen- or Llama-like config that ask for what this decoder does not do,
    with their values."""
    ropes = [rope_parameters(config, i) for i in range(config.num_hidden_layers)]
    rope_types = {rope.get("rope_type", rope.get("type", "default")) for rope in ropes}
    partial = {r.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
               for r in ropes} - {1.0}
    act = getattr(config, "hidden_act", "silu")
    quant = getattr(config, "quantization_config", None)  # a format's own checks: loader.py
    quant = quant if quant and quant.get("quant_method") not in QUANTIZATIONS else None
    found = {"hidden_act": act if act != "silu" else None,
             "rope_type": ", ".join(sorted(rope_types - ROPE_TYPES)) or None,
             "partial_rotary_factor": partial.pop() if partial else None,
             "layer_types": set(getattr(config, "layer_types", None) or ()) - LAYER_TYPES or None,
             "quant_method": quant.get("quant_method", "none") if quant else None}
    return {name: value for name, value in found.items() if value is not None}


class DecoderAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, backend: str, index: int):
        super().__init__()
        arch = config.architectures[0]
        self.head_dim = (getattr(config, "head_dim", None)
                         or config.hidden_size // config.num_attention_heads)
        self.num_heads = config.num_attention_heads // tp_size()
        self.num_kv_heads = config.num_key_value_heads // tp_size()
        qkv_bias = arch in QKV_BIAS or getattr(config, "attention_bias", False)
        o_bias = arch not in QKV_BIAS and getattr(config, "attention_bias", False)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim,
                                          config.num_attention_heads, config.num_key_value_heads,
                                          bias=qkv_bias)
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim,
                                        config.hidden_size, bias=o_bias)
        self.qk_norm = arch in QK_NORM
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(self.head_dim, config.max_position_embeddings,
                                          rope_parameters(config, index))
        self.attn = Attention(self.head_dim, backend, sliding_window=sliding_window(config, index))

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
    attention = DecoderAttention

    def __init__(self, config: PretrainedConfig, backend: str, index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = self.attention(config, backend, index)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = self.make_mlp(config, backend, index)

    def make_mlp(self, config: PretrainedConfig, backend: str, index: int) -> nn.Module:
        """The layer's feed-forward block: a model family may make another (experts, say)."""
        return MLP(config)

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
    def __init__(self, config: PretrainedConfig, backend: str, layer: type = DecoderLayer):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layer(config, backend, i)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None  # (T, C)
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, meta)
        return self.norm(hidden, residual)[0]


class CausalLM(nn.Module):
    """The decoder and the LM head. `unsupported(config)` names what a config asks for that the
    model does not do; `checkpoint_param` and `param_parts` guide the loader; `sliding_window`
    is the window when every layer slides (the block manager gives back blocks before it)."""
    unsupported = staticmethod(unsupported_fields)
    decoder_layer = DecoderLayer

    # checkpoint name fragment -> (packed parameter fragment, shard id)
    packed_modules = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, config: PretrainedConfig, backend: str):
        super().__init__()
        self.model = DecoderModel(config, backend, self.decoder_layer)
        self.backend = backend
        windows = {sliding_window(config, i) for i in range(config.num_hidden_layers)}
        self.sliding_window = windows.pop() if len(windows) == 1 else None
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.tie_word_embeddings = getattr(config, "tie_word_embeddings", False)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def checkpoint_param(self, name: str) -> tuple[str, str | int | None]:
        """The parameter the checkpoint tensor `name` fills, and the part (None: all of it)."""
        for fragment, (packed, part) in self.packed_modules.items():
            if f".{fragment}." in name:
                return name.replace(fragment, packed), part
        return name, None

    def param_parts(self, name: str) -> list:
        """The parts of the parameter `name` that checkpoint tensors fill."""
        return [p for packed, p in self.packed_modules.values() if f".{packed}." in name] or [None]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """(2, num_layers, num_blocks, block_size, nkv, hs): every layer's K and V cache."""
        attn = self.model.layers[0].self_attn
        return 2, len(self.model.layers), num_blocks, block_size, attn.num_kv_heads, attn.head_dim

    def allocate_kv_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype,
                          device: torch.device) -> torch.Tensor:
        """One zeroed tensor of `kv_cache_shape` (backend's `zeros`); each layer gets views."""
        shape = self.kv_cache_shape(num_blocks, block_size)
        kv_cache = BACKENDS[self.backend].zeros(shape, dtype=dtype, device=device)
        for i, layer in enumerate(self.model.layers):
            layer.self_attn.attn.k_cache = kv_cache[0, i]
            layer.self_attn.attn.v_cache = kv_cache[1, i]
        return kv_cache


# architecture name (a checkpoint's `architectures`) -> its model class
ARCHITECTURES: dict[str, type[nn.Module]] = dict.fromkeys(
    ("Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM"), CausalLM)
