"""Mixture of experts: Qwen3-MoE and Mixtral, the core's decoder with a sparse
feed-forward block.

A router scores every expert for each token: softmax, then the `num_experts_per_tok`
best experts, whose weights are renormalised to sum to 1 (always in Mixtral; in
Qwen3-MoE when `norm_topk_prob`). The token's output is the weighted sum of those
experts' SwiGLU MLPs. The experts' weights are stacked, `gate_up` (E, 2I, H) and `down`
(E, H, I), filled from the checkpoint's per-expert matrices; tensor parallelism splits
each expert's I, and the ranks' partial sums are all-reduced, as a row-parallel
linear's. On the CPU backends ("torch", "cpu") the experts run as plain PyTorch, one
matmul per expert that has tokens (the reference); on the GPU backends as the fused
Triton kernels of `moe_triton.py`.
"""

import re

import torch
import torch.distributed as dist
from torch import nn
from transformers import PretrainedConfig

from nanopaged.checks import unsupported_fields
from nanopaged.core.layers import (
    Kernels,
    LinearBase,
    silu_and_mul,
    tp_rank,
    tp_shard,
    tp_size,
)
from nanopaged.core.model import MLP, CausalLM, DecoderLayer


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, E) router logits -> each token's top_k experts' weights (float32) and ids (T,
    K)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def experts_torch(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """The reference: the (token, expert) pairs grouped by expert, one SwiGLU per expert
    that has pairs, each pair's output weighted and summed into its token's row."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    order = topk_ids.flatten().argsort(stable=True)
    counts = torch.bincount(topk_ids.flatten(), minlength=gate_up.shape[0]).tolist()
    top_k, start = topk_ids.shape[1], 0
    for expert, count in enumerate(counts):
        pairs, start = order[start : start + count], start + count
        if count:
            tokens = pairs // top_k
            y = silu_and_mul(x[tokens] @ gate_up[expert].T) @ down[expert].T
            out.index_add_(0, tokens, y.float() * topk_weights.flatten()[pairs, None])
    return out.to(x.dtype)


class Experts(nn.Module):
    """Every expert's weights, stacked; this rank's slice of each expert's intermediate
    size."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.tp_rank = tp_rank()
        self.tp_size = tp_size()
        size = intermediate_size // self.tp_size
        self.gate_up = nn.Parameter(
            torch.empty(num_experts, 2 * size, hidden_size), requires_grad=False
        )
        self.down = nn.Parameter(
            torch.empty(num_experts, hidden_size, size), requires_grad=False
        )

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard: tuple[int, int | None]
    ) -> None:
        """Copies one expert's matrix: its gate (part 0) or up (part 1) projection into
        `gate_up`, or its down projection (part None) into `down`."""
        expert, part = shard
        if part is None:
            param.data[expert].copy_(tp_shard(loaded, 1, self.tp_rank, self.tp_size))
        else:
            size = param.shape[1] // 2
            param.data[expert].narrow(0, part * size, size).copy_(
                tp_shard(loaded, 0, self.tp_rank, self.tp_size)
            )


class SparseMoeBlock(nn.Module):
    """The router (`gate`) and the experts of one layer."""

    def __init__(self, config: PretrainedConfig, kernels: Kernels):
        super().__init__()
        self.num_experts = num_experts(config)
        self.top_k = config.num_experts_per_tok
        # Mixtral always does
        self.renormalize = getattr(config, "norm_topk_prob", True)
        size = (
            getattr(config, "moe_intermediate_size", None) or config.intermediate_size
        )
        self.gate = LinearBase(
            config.hidden_size, self.num_experts, False, kernels.linear
        )
        self.experts = Experts(self.num_experts, config.hidden_size, size)
        on_gpu = kernels.backend in ("triton", "flash")
        self.run_experts = _fused_experts if on_gpu else experts_torch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        out = self.run_experts(x, self.experts.gate_up, self.experts.down, weights, ids)
        if self.experts.tp_size > 1:
            dist.all_reduce(out)
        return out


def _fused_experts(*args) -> torch.Tensor:
    # triton: only off the torch backend
    from nanopaged.models.moe_triton import fused_experts

    return fused_experts(*args)


def num_experts(config: PretrainedConfig) -> int:
    return getattr(config, "num_experts", None) or config.num_local_experts


class MoeLayer(DecoderLayer):
    """A decoder layer whose feed-forward block is sparse, but on Qwen3-MoE's
    `mlp_only_layers` and, with `decoder_sparse_step` n, on all but every n-th layer."""

    def make_mlp(
        self, config: PretrainedConfig, kernels: Kernels, index: int
    ) -> nn.Module:
        dense = (
            index in (getattr(config, "mlp_only_layers", None) or ())
            or (index + 1) % getattr(config, "decoder_sparse_step", 1) != 0
        )
        return MLP(config, kernels) if dense else SparseMoeBlock(config, kernels)


# A checkpoint's expert matrix: (layer prefix, expert, matrix name)
EXPERT_MATRIX = re.compile(
    r"(.*)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$"
)
# its matrix name (Qwen3-MoE's, Mixtral's) -> the stacked parameter and the part it
# fills
EXPERT_PARTS = {
    "gate_proj": ("gate_up", 0),
    "up_proj": ("gate_up", 1),
    "down_proj": ("down", None),
    "w1": ("gate_up", 0),
    "w3": ("gate_up", 1),
    "w2": ("down", None),
}


class MoeForCausalLM(CausalLM):
    """Qwen3-MoE and Mixtral (whose checkpoints call the layer's block
    `block_sparse_moe`)."""

    decoder_layer = MoeLayer

    def __init__(self, config: PretrainedConfig, kernels: Kernels):
        super().__init__(config, kernels)
        self.num_experts = num_experts(config)

    def checkpoint_param(self, name: str) -> tuple[str, object]:
        match = EXPERT_MATRIX.match(name)
        if match is None:
            return super().checkpoint_param(name.replace(".block_sparse_moe.", ".mlp."))
        layer, expert, matrix = match.groups()
        if matrix not in EXPERT_PARTS:
            return name, None  # the loader names it: unexpected weight
        param, part = EXPERT_PARTS[matrix]
        return f"{layer}.mlp.experts.{param}", (int(expert), part)

    def param_parts(self, name: str) -> list:
        if ".experts." not in name:
            return super().param_parts(name)
        parts = (0, 1) if name.endswith(".gate_up") else (None,)
        return [(expert, part) for expert in range(self.num_experts) for part in parts]


def unsupported_moe_fields(config: PretrainedConfig) -> dict:
    """The core's checks, and quantized experts (which nanopaged does not implement)."""
    quant = getattr(config, "quantization_config", None) or {}
    experts = {
        "quantization_config (quantized experts)": quant.get("quant_method", "?")
    }
    return unsupported_fields(config) | (experts if quant else {})
