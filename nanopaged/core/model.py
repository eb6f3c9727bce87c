"""One decoder for Qwen3 (q and k normalised per head), Qwen2 (q/k/v biases) and Llama.
Other families stand above the core (`nanopaged/models/`): a `CausalLM` subclass with
its own `decoder_layer`, entered in `ARCHITECTURES` (and `QK_NORM` or `QKV_BIAS`) by its
module. What a config asks that no decoder does is refused above (`checks.py`)."""

import torch
from torch import nn
from transformers import PretrainedConfig

from nanopaged.core.attention import Attention, AttentionMetadata
from nanopaged.core.layers import (
    Kernels,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    tp_size,
)

QK_NORM = {"Qwen3ForCausalLM"}  # architectures whose q and k are normalised per head
QKV_BIAS = {"Qwen2ForCausalLM"}  # whose q/k/v projections have biases (and o's none)


def rope_parameters(config: PretrainedConfig, index: int = 0) -> dict:
    """Layer `index`'s RoPE parameters (transformers keys them by layer type where the
    types' differ, as Gemma 3's)."""
    params = getattr(config, "rope_parameters", None) or dict(
        getattr(config, "rope_scaling", None) or {}, rope_theta=config.rope_theta
    )
    types = getattr(config, "layer_types", None)
    return dict(params.get(types[index], params) if types else params)


def sliding_window(config: PretrainedConfig, index: int) -> int | None:
    """Layer `index`'s window: the config's `sliding_window`, on the layers its
    `layer_types` marks sliding (on every layer without `layer_types`, as Mistral's)."""
    types = getattr(config, "layer_types", None)
    slides = types is None or types[index] == "sliding_attention"
    return getattr(config, "sliding_window", None) if slides else None


class DecoderAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, kernels: Kernels, index: int):
        super().__init__()
        architecture = config.architectures[0]
        hidden_size = config.hidden_size
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        head_dim = getattr(config, "head_dim", None) or hidden_size // heads
        self.head_dim = head_dim
        self.num_heads = heads // tp_size()
        self.num_kv_heads = kv_heads // tp_size()
        # `attention_bias` biases all four projections; the families of QKV_BIAS bias
        # q, k and v whatever it says, and then never o
        attention_bias = getattr(config, "attention_bias", False)
        qkv_bias = attention_bias or architecture in QKV_BIAS
        o_bias = attention_bias and architecture not in QKV_BIAS
        self.qkv_proj = QKVParallelLinear(
            hidden_size, head_dim, heads, kv_heads, qkv_bias, kernels.projections
        )
        self.o_proj = RowParallelLinear(
            heads * head_dim, hidden_size, o_bias, kernels.projections
        )
        self.qk_norm = architecture in QK_NORM
        if self.qk_norm:
            self.q_norm = RMSNorm(head_dim, config.rms_norm_eps, kernels)
            self.k_norm = RMSNorm(head_dim, config.rms_norm_eps, kernels)
        self.rotary_emb = RotaryEmbedding(
            head_dim,
            config.max_position_embeddings,
            rope_parameters(config, index),
            kernels,
        )
        window = sliding_window(config, index)
        self.attn = Attention(head_dim, kernels, window=window)

    def forward(self, positions, hidden: torch.Tensor, meta: AttentionMetadata):
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(hidden).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # (T, nh, hs)
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # (T, nkv, hs)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v, meta)
        return self.o_proj(out.flatten(1))


class MLP(nn.Module):
    def __init__(self, config: PretrainedConfig, kernels: Kernels):
        super().__init__()
        intermediate_size, hidden_size = config.intermediate_size, config.hidden_size
        bias = getattr(config, "mlp_bias", False)
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, bias, kernels.projections
        )
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, bias, kernels.projections
        )
        self.act = kernels.silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    attention = DecoderAttention

    def __init__(self, config: PretrainedConfig, kernels: Kernels, index: int):
        super().__init__()
        hidden_size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden_size, eps, kernels)
        self.self_attn = self.attention(config, kernels, index)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps, kernels)
        self.mlp = self.make_mlp(config, kernels, index)

    def make_mlp(self, config: PretrainedConfig, kernels: Kernels, index: int):
        """The layer's feed-forward block: a family may make another (experts, say)."""
        return MLP(config, kernels)

    def forward(self, positions, hidden, residual, meta: AttentionMetadata):
        """Returns (this layer's output, the residual stream before it): the next norm
        adds them, which fuses the residual add into the norm's kernel."""
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    def __init__(self, config: PretrainedConfig, kernels: Kernels, layer: type):
        super().__init__()
        hidden_size = config.hidden_size
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden_size)
        self.layers = nn.ModuleList(
            layer(config, kernels, index) for index in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(hidden_size, config.rms_norm_eps, kernels)

    def forward(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None  # (T, C)
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, meta)
        return self.norm(hidden, residual)[0]


class CausalLM(nn.Module):
    """The decoder and the LM head, its layers computing with `kernels`.
    `checkpoint_param` and `param_parts` guide the loader; `sliding_window` is the
    window when every layer slides (the block manager gives back blocks before it)."""

    decoder_layer = DecoderLayer
    # checkpoint name fragment -> (packed parameter fragment, shard id)
    packed_modules = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: PretrainedConfig, kernels: Kernels):
        super().__init__()
        self.model = DecoderModel(config, kernels, self.decoder_layer)
        windows = {sliding_window(config, i) for i in range(config.num_hidden_layers)}
        self.sliding_window = windows.pop() if len(windows) == 1 else None
        self.lm_head = ParallelLMHead(
            config.vocab_size, config.hidden_size, kernels.linear
        )
        self.tie_word_embeddings = getattr(config, "tie_word_embeddings", False)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def checkpoint_param(self, name: str) -> tuple[str, str | int | None]:
        """The parameter checkpoint tensor `name` fills, and the part (None: all)."""
        for fragment, (packed, part) in self.packed_modules.items():
            if f".{fragment}." in name:
                return name.replace(fragment, packed), part
        return name, None

    def param_parts(self, name: str) -> list:
        """The parts of the parameter `name` that checkpoint tensors fill."""
        packed = self.packed_modules.values()
        return [part for fragment, part in packed if f".{fragment}." in name] or [None]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """(2, num_layers, num_blocks, block_size, nkv, hs): every layer's K and V."""
        attn = self.model.layers[0].self_attn
        num_layers = len(self.model.layers)
        return 2, num_layers, num_blocks, block_size, attn.num_kv_heads, attn.head_dim

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        """Gives each layer its views of `kv_cache` (of `kv_cache_shape`)."""
        for i, layer in enumerate(self.model.layers):
            layer.self_attn.attn.k_cache = kv_cache[0, i]
            layer.self_attn.attn.v_cache = kv_cache[1, i]


# architecture name (a checkpoint's `architectures`) -> its model class
ARCHITECTURES: dict[str, type[nn.Module]] = dict.fromkeys(
    ("Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM"), CausalLM
)
