"""GPTQ checkpoints (`quant_method: "gptq"`, 4 bits, as AutoGPTQ and GPTQModel write
them). A projection of `in` inputs and `out` outputs stores, in groups of `group_size`
inputs (-1: one group):
- `qweight`, int32 (in / 8, out): eight 4-bit values per word along the *inputs*, in
  order (input 8w + i at bits 4i of word w);
- `qzeros`, int32 (groups, out / 8): each group's zero points, eight per word along the
  outputs, in order; the classic format (`checkpoint_format` "gptq") stores zero - 1
  (AutoGPTQ's long-kept off-by-one), "gptq_v2" the zero itself;
- `scales`, float16 (groups, out); `g_idx`, int32 (in,): each input's group.
The weight is (value - zero) x scale. With `desc_act` the inputs are quantized in
another order and `g_idx` is not monotonic: not implemented. On a GPU the weight is
multiplied 4-bit by a kernel, elsewhere dequantized once loaded (see `Int4Linear`)."""

import torch
from torch import nn

from nanopaged.core.layers import LinearMethod, parameter
from nanopaged.quantization.dequantize import (
    Int4Linear,
    check_group,
    check_keys,
    finite,
    unpack_int4,
)


class GptqLinear(Int4Linear):
    def __init__(self, dense: LinearMethod, group_size: int, zero_offset: int):
        super().__init__(dense)
        self.group_size = group_size
        self.zero_offset = zero_offset

    def tensors(self, in_features: int, out_features: int) -> dict[str, nn.Parameter]:
        group = self.group_size if self.group_size > 0 else in_features
        check_group("group_size", in_features, group)
        check_group("bits=4: qweight packs 8 inputs a word; group_size", in_features, 8)
        groups = in_features // group
        return {
            "qweight": parameter(
                torch.empty(in_features // 8, out_features, dtype=torch.int32),
                1,
                0,
                input_pack=8,
            ),
            "qzeros": parameter(
                torch.empty(groups, out_features // 8, dtype=torch.int32),
                1,
                0,
                output_pack=8,
                input_pack=group,
            ),
            "scales": parameter(
                torch.empty(groups, out_features, dtype=torch.float16),
                1,
                0,
                input_pack=group,
                checks=(finite,),
            ),
            "g_idx": parameter(
                torch.empty(in_features, dtype=torch.int32),
                None,
                0,
                checks=(self.in_group_order,),
            ),
        }

    def in_group_order(self, g_idx: torch.Tensor) -> str | None:
        """Whether a part's g_idx (each input's group) is in order: with `desc_act` it
        is not, which nanopaged does not implement."""
        group = self.group_size if self.group_size > 0 else len(g_idx)
        in_order = torch.arange(len(g_idx)) // group
        if g_idx.dim() != 1 or not torch.equal(g_idx.long() - g_idx[0], in_order):
            return (
                "does not put the inputs in order of their groups (a desc_act "
                "checkpoint?), which nanopaged does not implement"
            )
        return None

    def int4(
        self, layer: nn.Module
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        in_features = layer.g_idx.shape[0]
        group = self.group_size if self.group_size > 0 else in_features
        zeros = (unpack_int4(layer.qzeros, 1) + self.zero_offset) & 0xF  # (groups, out)
        return unpack_int4(layer.qweight, 0), zeros, layer.scales, group


def gptq_method(config: dict, dense: LinearMethod) -> GptqLinear:
    form = config.get("checkpoint_format") or config.get("format") or "gptq"
    check_keys(
        "gptq",
        dict(config, checkpoint_format=form),
        {
            "bits": [4],
            "desc_act": [False],
            "lm_head": [False],
            "checkpoint_format": ["gptq", "gptq_v2"],
        },
    )
    group_size = config.get("group_size", 128)
    if not isinstance(group_size, int) or not (group_size == -1 or group_size > 0):
        raise ValueError(
            f"the checkpoint's gptq group_size must be -1 or positive, "
            f"got {group_size!r}"
        )
    return GptqLinear(dense, group_size, 1 if form == "gptq" else 0)
