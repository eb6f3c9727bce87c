"""What the quantized formats share: their tensors, stored as the checkpoint has them,
become once loaded one float weight (out, in) that the device's linear method
multiplies. The numbers are exact: each value is the product (or the difference times
the scale) the format defines, computed in float32, then cast to the model's dtype."""

import torch
from torch import nn

from nanopaged.core.layers import LinearMethod, parameter

# the 8 four-bit values of an int32
NIBBLE_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


class DequantizedLinear(LinearMethod):
    """A format's tensors (`tensors(in_features, out_features)`, each a
    `layers.parameter`) turned into the float weight by `dequantize(layer)`, then
    multiplied by `dense`."""

    def __init__(self, dense: LinearMethod):
        self.dense = dense

    def tensors(self, in_features: int, out_features: int) -> dict[str, nn.Parameter]:
        raise NotImplementedError

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        raise NotImplementedError

    def create_weights(
        self, layer: nn.Module, in_features: int, out_features: int
    ) -> None:
        layer.float_dtype = torch.get_default_dtype()
        layer.quantized = self.tensors(in_features, out_features)
        for name, param in layer.quantized.items():
            layer.register_parameter(name, param)

    def process_weights(self, layer: nn.Module) -> LinearMethod:
        weight = self.dequantize(layer).to(layer.float_dtype)
        drop_stored(layer)
        layer.weight = parameter(weight, 0, 1)
        return self.dense.process_weights(layer)


class Int4Linear(DequantizedLinear):
    """A 4-bit format (AWQ, GPTQ): `int4(layer)` reads its tensors as values (in, out),
    zero points and scales (groups, out) and the group size; the weight is (value -
    zero) x scale. On a GPU the layer keeps them 4-bit and multiplies with
    int4_triton.py's kernel (a quarter of the float weight's bytes); elsewhere they are
    dequantized once loaded."""

    def int4(
        self, layer: nn.Module
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        raise NotImplementedError

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        values, zeros, scales, group = self.int4(layer)
        zeros = zeros.repeat_interleave(group, 0)
        scales = scales.float().repeat_interleave(group, 0)
        return ((values - zeros).float() * scales).t()

    def process_weights(self, layer: nn.Module) -> LinearMethod:
        if not use_kernel(layer.qweight):
            return super().process_weights(layer)
        from nanopaged.quantization.int4_triton import Int4Kernel

        parts = self.int4(layer)
        drop_stored(layer)
        return Int4Kernel.keep(layer, *parts)


def finite(tensor: torch.Tensor) -> str | None:
    """A scale's check: every value a finite number (a NaN would give token 0 or
    garbage)."""
    return None if torch.isfinite(tensor.float()).all() else "holds NaN or infinities"


def drop_stored(layer: nn.Module) -> None:
    """Frees the tensors as the checkpoint stored them, once turned into what
    multiplies."""
    for name in layer.quantized:
        delattr(layer, name)
    del layer.quantized


def use_kernel(qweight: torch.Tensor) -> bool:
    """The 4-bit kernel runs where Triton compiles: on a GPU."""
    return qweight.is_cuda


def unpack_int4(
    words: torch.Tensor, dim: int, order: list[int] | None = None
) -> torch.Tensor:
    """The 4-bit values of int32 `words`, eight per word along `dim` (the lowest bits
    first), placed in `order` (value i of a word is feature order[i] of its eight; None:
    in turn)."""
    values = (words.unsqueeze(-1) >> NIBBLE_SHIFTS.to(words.device)) & 0xF  # (..., 8)
    if order is not None:
        values = values[..., torch.tensor(order).argsort()]
    return values.movedim(-1, dim + 1).flatten(dim, dim + 1)


def check_group(name: str, features: int, group: int) -> None:
    if features % group:
        raise ValueError(
            f"{name}={group} does not divide a projection's {features} input "
            f"features (on each tensor-parallel rank)"
        )


def check_keys(method: str, config: dict, expected: dict) -> None:
    """A ValueError naming the first field of `config` whose value is not among
    `expected[name]` (a field it lacks counts as its default, the first)."""
    for name, allowed in expected.items():
        value = config.get(name, allowed[0])
        if value not in allowed:
            raise ValueError(
                f"the checkpoint's {method} quantization_config has {name}="
                f"{value!r}, which nanopaged does not implement (it does "
                f"{', '.join(map(repr, allowed))})"
            )


def check_skipped(field: str, modules) -> None:
    """Formats keep some modules unquantized: here only those outside the
    projections."""
    kept = [m for m in modules or () if "proj" in m]
    if kept:
        raise ValueError(
            f"the checkpoint's quantization_config leaves {kept[0]!r} unquantized "
            f"({field}), which nanopaged does not implement"
        )
