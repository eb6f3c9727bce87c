"""A LoRA adapter in peft's format, read and checked against the model, staged on the
host in the layout of a slot (punica.py): what loading it into a slot copies."""

import json
import math
import os
import re
from dataclasses import dataclass

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from nanopaged.core.layers import ColumnParallelLinear, RowParallelLinear, parameter
from nanopaged.lora.request import LoRARequest

# peft's config fields that change what the adapted model computes beyond W + (alpha/r)
# B A, and the value that leaves them off
REFUSED = {
    "use_dora": False,
    "modules_to_save": None,
    "bias": "none",
    "lora_bias": False,
    "fan_in_fan_out": False,
    "trainable_token_indices": None,
    "layer_replication": None,
    "alora_invocation_tokens": None,
    "use_qalora": False,
    "target_parameters": None,
    "alpha_pattern": {},
    "arrow_config": None,
    "use_bdlora": None,
}
TENSOR = re.compile(r"(?:base_model\.model\.)?(.+)\.lora_([AB])(?:\.[^.]+)?\.weight")


@dataclass
class LoRAConfig:
    """vLLM's LoRA options: `max_loras` adapters in device slots at once (the engine
    runs at most that many in a step), each of rank at most `max_lora_rank`, and
    `max_cpu_loras` kept read on the host (at least `max_loras`; default: as many)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        if (
            isinstance(self.max_cpu_loras, bool)
            or not isinstance(self.max_cpu_loras, int)
            or self.max_cpu_loras < self.max_loras
        ):
            raise ValueError(
                f"max_cpu_loras must be an integer >= max_loras={self.max_loras}, "
                f"got {self.max_cpu_loras!r}"
            )


def adaptable(module: nn.Module) -> bool:
    """The projections an adapter may change: attention's and the MLPs' (not a MoE's
    experts or router, not the embeddings or the LM head)."""
    return isinstance(module, (ColumnParallelLinear, RowParallelLinear))


def read_config(request: LoRARequest) -> dict:
    """The adapter's adapter_config.json, checked: a LoRA that computes W + scaling B
    A."""
    path = os.path.join(request.lora_path, "adapter_config.json")
    name = request.lora_name
    try:
        with open(path) as f:
            config = json.load(f)
    except OSError as error:
        raise ValueError(
            f"LoRA adapter {name!r}: cannot read {path}: {error.strerror}"
        ) from None
    except json.JSONDecodeError as error:
        raise ValueError(
            f"LoRA adapter {name!r}: {path} is not valid JSON: {error}"
        ) from None
    kind = (
        config.get("peft_type", "LORA")
        if isinstance(config, dict)
        else type(config).__name__
    )
    if kind != "LORA":
        raise ValueError(
            f"LoRA adapter {name!r}: {path} is not a peft LoRA config ({kind})"
        )
    for field, off in REFUSED.items():
        value = config.get(field, off)
        if value != off and not (off in (None, {}, False) and not value):
            raise ValueError(
                f"LoRA adapter {name!r}: {field}={value!r} is not supported "
                f"(nanopaged serves plain LoRA: W + scaling B A)"
            )
    for field in ("r", "lora_alpha"):
        value = config.get(field)
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or not math.isfinite(value) or value <= 0:
            raise ValueError(
                f"LoRA adapter {name!r}: {field} must be a positive number, got "
                f"{config.get(field)!r}"
            )
    return config


def stage(
    request: LoRARequest, model: nn.Module, max_rank: int, dtype: torch.dtype
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The adapter at `request.lora_path` as one slot's (a (P*R, in), b (out, P*R)) for
    each projection it changes (by module name), this rank's shard, B times the scaling.
    A ValueError names what is wrong: no directory, a bad config, a rank over
    `max_rank`, a module the model has not or that nanopaged does not adapt, a shape
    that does not fit."""
    config = read_config(request)
    name = request.lora_name
    file = os.path.join(request.lora_path, "adapter_model.safetensors")
    try:
        tensors = load_file(file)
    except (OSError, SafetensorError) as error:
        raise ValueError(
            f"LoRA adapter {name!r}: cannot read {file}: {error}"
        ) from None
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = TENSOR.fullmatch(key)
        if match is None:
            raise ValueError(
                f"LoRA adapter {name!r}: tensor {key!r} is not a LoRA A or B "
                f"matrix (embeddings, DoRA and biases are not supported)"
            )
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise ValueError(
                f"LoRA adapter {name!r}: tensor {key!r} in {file} holds NaN or "
                f"infinite values"
            )
        pairs.setdefault(match.group(1), {})[match.group(2)] = tensor
    modules = dict(model.named_modules())
    targets = {
        module: _target(name, model, modules, module, pair)
        for module, pair in pairs.items()
    }
    staged: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, pair in pairs.items():
        param, part, layer = targets[module]
        layer_name = param.removesuffix(".weight")
        a, b = pair["A"], pair["B"]
        rank = a.shape[0]
        if rank > max_rank:
            raise ValueError(
                f"LoRA adapter {name!r} has rank {rank} (in {module}), over "
                f"max_lora_rank={max_rank}"
            )
        if b.dim() != 2 or b.shape[1] != rank:
            raise ValueError(
                f"LoRA adapter {name!r}: {module}'s lora_B {tuple(b.shape)} does "
                f"not fit its lora_A {tuple(a.shape)}"
            )
        alpha = config["lora_alpha"]
        scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        parts = model.param_parts(param)
        if layer_name not in staged:
            staged[layer_name] = empty_slot(layer, len(parts), max_rank, dtype)
        slot_a, slot_b = staged[layer_name]
        p = parts.index(part)
        try:
            _load(
                layer,
                slot_a[p * max_rank : (p + 1) * max_rank],
                _pad(a, max_rank, 0),
                part,
                input_dim=1,
            )
            _load(
                layer,
                slot_b[:, p * max_rank : (p + 1) * max_rank],
                _pad(b.float() * scaling, max_rank, 1),
                part,
                output_dim=0,
            )
        except (RuntimeError, ValueError) as error:
            raise ValueError(
                f"LoRA adapter {name!r}: {module}'s matrices do not fit the "
                f"model: {error}"
            ) from None
    if not staged:
        raise ValueError(f"LoRA adapter {name!r}: {file} holds no LoRA matrices")
    for layer_name, (slot_a, slot_b) in staged.items():
        if not (torch.isfinite(slot_a).all() and torch.isfinite(slot_b).all()):
            raise ValueError(
                f"LoRA adapter {name!r}: {layer_name}'s lora_B times its scaling is "
                f"not finite in {dtype}"
            )
    return staged


def _target(
    name: str,
    model: nn.Module,
    modules: dict[str, nn.Module],
    module: str,
    pair: dict[str, torch.Tensor],
) -> tuple[str, object, nn.Module]:
    """The model's parameter, its part and its layer that the adapter's `module`
    changes, checked before anything is loaded: a whole adapter is refused for a wrong
    target first."""
    if set(pair) != {"A", "B"}:
        raise ValueError(
            f"LoRA adapter {name!r}: {module} has lora_{set(pair).pop()} alone"
        )
    param, part = model.checkpoint_param(module + ".weight")
    layer = modules.get(param.removesuffix(".weight"))
    if layer is None or not adaptable(layer):
        raise ValueError(
            f"LoRA adapter {name!r} targets {module}, which "
            + (
                "the model does not have"
                if layer is None
                else "nanopaged does not adapt (only the attention and MLP projections)"
            )
        )
    return param, part, layer


def empty_slot(
    layer: nn.Module,
    num_parts: int,
    max_rank: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed (a, b) of one slot of `layer` (this rank's features)."""
    return (
        torch.zeros(
            num_parts * max_rank, layer.in_features, dtype=dtype, device=device
        ),
        torch.zeros(
            layer.out_features, num_parts * max_rank, dtype=dtype, device=device
        ),
    )


def _pad(tensor: torch.Tensor, size: int, dim: int) -> torch.Tensor:
    """`tensor` with zeros appended along `dim` up to `size` (a rank below the
    slot's)."""
    pad = [0, 0] * (tensor.dim() - dim - 1) + [0, size - tensor.shape[dim]]
    return torch.nn.functional.pad(tensor.float(), pad)


def _load(
    layer: nn.Module,
    target: torch.Tensor,
    tensor: torch.Tensor,
    part,
    output_dim: int | None = None,
    input_dim: int | None = None,
) -> None:
    """Copies this rank's shard of `tensor` (and its part of a packed projection) into
    `target` through the layer's own weight loader, which knows the sharding: a
    column-parallel layer splits B's output rows, a row-parallel one A's input
    columns."""
    layer.weight_loader(
        parameter(target, output_dim, input_dim), tensor.to(target.dtype), part
    )
