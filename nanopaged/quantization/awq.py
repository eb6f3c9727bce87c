"""AWQ checkpoints (`quant_method: "awq"`, `version: "gemm"`, 4 bits, as AutoAWQ writes
them). A projection of `in` inputs and `out` outputs stores, in groups of `group_size`
inputs:
- `qweight`, int32 (in, out / 8): eight 4-bit values per word along the outputs, in
  AutoAWQ's interleaved order (the word's value i, at bits 4i, is output [0, 2, 4, 6, 1,
  3, 5, 7][i] of its eight);
- `qzeros`, int32 (in / group_size, out / 8): each group's zero points, packed the same
  way;
- `scales`, float16 (in / group_size, out).
The weight is (value - zero) x scale, each input taking its group's zero and scale: on a
GPU multiplied 4-bit by a kernel, elsewhere dequantized once loaded (see
`Int4Linear`)."""

import torch
from torch import nn

from nanopaged.core.layers import LinearMethod, parameter
from nanopaged.quantization.dequantize import (
    Int4Linear,
    check_group,
    check_keys,
    check_skipped,
    finite,
    unpack_int4,
)

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


class AwqLinear(Int4Linear):
    def __init__(self, dense: LinearMethod, group_size: int):
        super().__init__(dense)
        self.group_size = group_size

    def tensors(self, in_features: int, out_features: int) -> dict[str, nn.Parameter]:
        check_group("group_size", in_features, self.group_size)
        groups = in_features // self.group_size
        return {
            "qweight": parameter(
                torch.empty(in_features, out_features // 8, dtype=torch.int32),
                1,
                0,
                output_pack=8,
            ),
            "qzeros": parameter(
                torch.empty(groups, out_features // 8, dtype=torch.int32),
                1,
                0,
                output_pack=8,
                input_pack=self.group_size,
            ),
            "scales": parameter(
                torch.empty(groups, out_features, dtype=torch.float16),
                1,
                0,
                input_pack=self.group_size,
                checks=(finite,),
            ),
        }

    def int4(
        self, layer: nn.Module
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        return (
            unpack_int4(layer.qweight, 1, AWQ_ORDER),
            unpack_int4(layer.qzeros, 1, AWQ_ORDER),
            layer.scales,
            self.group_size,
        )


def awq_method(config: dict, dense: LinearMethod) -> AwqLinear:
    check_keys(
        "awq",
        config,
        {
            "bits": [4],
            "zero_point": [True],
            "version": ["gemm", "GEMM"],
            "group_size": [128, 64, 32],
        },
    )
    check_skipped("modules_to_not_convert", config.get("modules_to_not_convert"))
    return AwqLinear(dense, config.get("group_size", 128))
