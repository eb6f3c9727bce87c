"""FP8 checkpoints, `quant_method: "fp8"` (DeepSeek-V3's and Qwen3-*-FP8's layout, and
vLLM's per-tensor one). Each projection's `weight` is float8 e4m3, (out, in), with
- `weight_block_size: [bn, bk]`: `weight_scale_inv`, float32 (⌈out/bn⌉, ⌈in/bk⌉), one
  factor per bn x bk block (the name says inverse: it is what the stored values are
  multiplied by);
- without it: `weight_scale`, one float32 per tensor (of q, k and v each), and
  `input_scale` when `activation_scheme` is "static".
On a GPU with FP8 (compute capability 8.9 and up: Ada, Hopper), a bfloat16 model with a
scale per channel or per tensor and dynamic activations keeps the weight in FP8 and
multiplies with `torch._scaled_mm`, each token's activations quantized to e4m3 by their
own scale (vLLM's per-token dynamic scheme). Elsewhere (a CPU, blocks, static
`input_scale`) the weight is dequantized once loaded (value x its block's scale), as
transformers does on a machine without FP8, and activations stay in the model's
dtype."""

import torch
from torch import nn

from nanopaged.core.layers import LinearMethod, parameter
from nanopaged.core.sequence import cdiv
from nanopaged.quantization.dequantize import (
    DequantizedLinear,
    check_group,
    check_keys,
    check_skipped,
    drop_stored,
    finite,
)

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max


class Fp8Linear(DequantizedLinear):
    """e4m3 weights with a float32 scale per (bn, bk) block of `block`, else per output
    row (one per channel, or a tensor's one repeated over its rows); `static_input`
    keeps the checkpoint's `input_scale` (per row as well), which the dequantized weight
    does not use."""

    def __init__(
        self,
        dense: LinearMethod,
        scale_name: str,
        block: list[int] | None,
        static_input: bool,
    ):
        super().__init__(dense)
        self.scale_name = scale_name
        self.block = block
        self.static_input = static_input

    def tensors(self, in_features: int, out_features: int) -> dict[str, nn.Parameter]:
        weight = parameter(
            torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn), 0, 1
        )
        if self.block:
            bn, bk = self.block
            check_group("weight_block_size", in_features, bk)
            shape = (cdiv(out_features, bn), cdiv(in_features, bk))
            scale = torch.empty(shape, dtype=torch.float32)
            scale = parameter(scale, 0, 1, bn, bk, checks=(finite,))
        else:
            scale = torch.empty(out_features, 1, dtype=torch.float32)
            scale = parameter(scale, 0, checks=(finite,))
        found = {"weight": weight, self.scale_name: scale}
        if self.static_input:
            scale = torch.empty(out_features, 1)
            found["input_scale"] = parameter(scale, 0, checks=(finite,))
        return found

    def process_weights(self, layer: nn.Module) -> LinearMethod:
        if self.block or self.static_input or not use_scaled_mm(layer):
            return super().process_weights(layer)
        weight, scale = layer.weight, getattr(layer, self.scale_name)
        drop_stored(layer)
        # (in, out), column-major: what _scaled_mm takes
        layer.weight_t = weight.data.t()
        layer.weight_scale = scale.data.reshape(1, -1).float().contiguous()  # (1, out)
        return Fp8ScaledMM()

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        weight = layer.weight.float()
        scale = getattr(layer, self.scale_name)
        if self.block:
            bn, bk = self.block
            scale = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)
            scale = scale[: weight.shape[0], : weight.shape[1]]
        return weight * scale


def use_scaled_mm(layer: nn.Module) -> bool:
    """FP8 GEMMs where the GPU has them; bfloat16 out (what per-row scales give there);
    dims that cuBLAS's FP8 GEMM takes (multiples of 16)."""
    weight = layer.weight
    return (
        weight.is_cuda
        and torch.cuda.get_device_capability(weight.device) >= (8, 9)
        and layer.float_dtype == torch.bfloat16
        and weight.shape[0] % 16 == 0
        and weight.shape[1] % 16 == 0
    )


class Fp8ScaledMM(LinearMethod):
    """x @ W in FP8: each row of x quantized to e4m3 by its own scale (its largest
    magnitude over e4m3's), then `torch._scaled_mm` multiplies and applies both
    scales."""

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        scale = flat.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX
        quantized = (flat / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        out = torch._scaled_mm(
            quantized,
            layer.weight_t,
            scale_a=scale,
            scale_b=layer.weight_scale,
            out_dtype=x.dtype,
        )
        out = out.view(*x.shape[:-1], -1)
        return out if layer.bias is None else out + layer.bias


def fp8_method(config: dict, dense: LinearMethod) -> Fp8Linear:
    check_keys(
        "fp8", config, {"fmt": ["e4m3"], "activation_scheme": ["dynamic", "static"]}
    )
    check_skipped("ignored_layers", config.get("ignored_layers"))
    check_skipped("modules_to_not_convert", config.get("modules_to_not_convert"))
    block = config.get("weight_block_size")
    if block is not None and not (
        isinstance(block, list)
        and len(block) == 2
        and all(isinstance(b, int) and b > 0 for b in block)
    ):
        raise ValueError(
            f"the checkpoint's fp8 weight_block_size must be [rows, columns], "
            f"got {block!r}"
        )
    return Fp8Linear(
        dense,
        "weight_scale_inv" if block else "weight_scale",
        block,
        config.get("activation_scheme") == "static",
    )
