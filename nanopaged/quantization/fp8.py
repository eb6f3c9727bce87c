"""FP8 checkpoints, `quant_method: "fp8"` (DeepSeek-V3's and Qwen3-*-FP8's layout, and vLLM's
per-tensor one). Each projection's `weight` is float8 e4m3, (out, in), with
- `weight_block_size: [bn, bk]`: `weight_scale_inv`, float32 (⌈out/bn⌉, ⌈in/bk⌉), one factor
  per bn x bk block (the name says inverse: it is what the stored values are multiplied by);
- without it: `weight_scale`, one float32 per tensor (of q, k and v each), and `input_scale`
  when `activation_scheme` is "static".
vLLM multiplies in FP8 on GPUs that have it, quantizing activations per token group or with
`input_scale`; here the weight is dequantized once loaded (value x its block's scale), as
transformers does on a machine without FP8, and activations stay in the model's dtype."""
import torch
from torch import nn

from nanopaged.core.layers import QUANTIZATIONS, LinearMethod, parameter
from nanopaged.core.sequence import cdiv
from nanopaged.quantization.dequantize import (
    DequantizedLinear,
    check_group,
    check_keys,
    check_skipped,
)


class Fp8Linear(DequantizedLinear):
    """e4m3 weights with a float32 scale per (bn, bk) block of `block`, else per output row
    (one per channel, or a tensor's one repeated over its rows); `static_input` keeps the
    checkpoint's `input_scale` (per row as well), which the dequantized weight does not use."""

    def __init__(self, dense: LinearMethod, scale_name: str, block: list[int] | None,
                 static_input: bool):
        super().__init__(dense)
        self.scale_name = scale_name
        self.block = block
        self.static_input = static_input

    def tensors(self, in_features: int, out_features: int) -> dict[str, nn.Parameter]:
        weight = parameter(torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn), 0, 1)
        if self.block:
            bn, bk = self.block
            check_group("weight_block_size", in_features, bk)
            shape = (cdiv(out_features, bn), cdiv(in_features, bk))
            scale = parameter(torch.empty(shape, dtype=torch.float32), 0, 1, bn, bk)
        else:
            scale = parameter(torch.empty(out_features, 1, dtype=torch.float32), 0)
        found = {"weight": weight, self.scale_name: scale}
        if self.static_input:
            found["input_scale"] = parameter(torch.empty(out_features, 1), 0)
        return found

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        weight = layer.weight.float()
        scale = getattr(layer, self.scale_name)
        if self.block:
            bn, bk = self.block
            scale = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)
            scale = scale[:weight.shape[0], :weight.shape[1]]
        return weight * scale


def fp8_method(config: dict, dense: LinearMethod) -> Fp8Linear:
    check_keys("fp8", config, {"fmt": ["e4m3"], "activation_scheme": ["dynamic", "static"]})
    check_skipped("ignored_layers", config.get("ignored_layers"))
    check_skipped("modules_to_not_convert", config.get("modules_to_not_convert"))
    block = config.get("weight_block_size")
    if block is not None and not (isinstance(block, list) and len(block) == 2
                                  and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"the checkpoint's fp8 weight_block_size must be [rows, columns], "
                         f"got {block!r}")
    return Fp8Linear(dense, "weight_scale_inv" if block else "weight_scale", block,
                     config.get("activation_scheme") == "static")


QUANTIZATIONS["fp8"] = fp8_method
