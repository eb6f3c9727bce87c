"""Loads (sharded) safetensors checkpoints into the model's packed layout."""

import glob
import os
from collections.abc import Callable

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from nanopaged.core.attention import BACKENDS
from nanopaged.core.config import Config
from nanopaged.core.layers import LinearMethod
from nanopaged.core.model import ARCHITECTURES

# Checkpoint tensors the model has no parameter for, by design.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# a `quantization_config`'s quant_method -> its projections' method, made of the config
# and the float method: the formats of nanopaged/quantization/ enter themselves there
QUANTIZATIONS: dict[str, Callable[[dict, LinearMethod], LinearMethod]] = {}


def load_model(config: Config, device: torch.device) -> nn.Module:
    """The model of the checkpoint `config.model` (its config `config.hf_config`, of a
    supported architecture), built in `config.dtype` on `device` with the kernels of its
    attention backend, its projections quantized as `quantization_config` says."""
    hf_config = config.hf_config
    architecture = next(a for a in hf_config.architectures if a in ARCHITECTURES)
    kernels = BACKENDS[config.attention_backend].kernels()
    quant = getattr(hf_config, "quantization_config", None)
    if quant:
        method = QUANTIZATIONS[quant["quant_method"]]
        kernels.projections = method(quant, kernels.linear)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(config.dtype)
    try:
        with device:
            model = ARCHITECTURES[architecture](hf_config, kernels)
    finally:
        torch.set_default_dtype(default_dtype)
    load_weights(model, config.model)
    for module in model.modules():
        if isinstance(getattr(module, "method", None), LinearMethod):
            module.method = module.method.process_weights(module)
    return model


def load_weights(model: nn.Module, path: str) -> None:
    """Copies every tensor of the checkpoint at `path` into the parameter (and part:
    q/k/v, gate/up, an expert's) `model.checkpoint_param` names, through its module's
    `weight_loader` if it has one. A tensor with no parameter, or a part no tensor
    filled, is a ValueError."""
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in {path!r}")
    params = dict(model.named_parameters(remove_duplicate=False))
    # a tied LM head is the embedding: the checkpoint's copy, if any, is not read
    tied = {"lm_head.weight"} if getattr(model, "tie_word_embeddings", False) else set()
    unfilled = {
        (name, part) for name in set(params) - tied for part in model.param_parts(name)
    }
    for file in files:
        try:
            with safe_open(file, "pt", "cpu") as f:
                for name in set(f.keys()) - tied:
                    if not name.endswith(IGNORED_SUFFIXES):
                        unfilled.discard(load_tensor(model, params, name, f, file))
        except SafetensorError as error:
            raise ValueError(
                f"cannot read {file}: {error} (a truncated download?)"
            ) from None
    if unfilled:
        shown = sorted(
            name + ("" if p is None else f" (part {p})") for name, p in unfilled
        )
        raise ValueError(f"checkpoint {path!r} is missing weights: {', '.join(shown)}")


def load_tensor(model: nn.Module, params: dict, name: str, f, file: str) -> tuple:
    """Loads checkpoint tensor `name` into its parameter; returns (parameter, part)."""
    param_name, part = model.checkpoint_param(name)
    if param_name not in params:
        raise ValueError(f"unexpected weight {name!r} in {file}")
    param, tensor = params[param_name], f.get_tensor(name)
    owner = model.get_submodule(param_name.rpartition(".")[0])
    # the first problem found, if any: each check returns what is wrong, or None
    problems = [check(tensor) for check in getattr(param, "checks", ())]
    if not stored_dtype_fits(tensor, param):
        problems.insert(0, f"is stored as {tensor.dtype}, not {param.dtype}")
    problems = [problem for problem in problems if problem]
    if problems:
        raise ValueError(f"weight {name!r} in {file} {problems[0]}")
    try:
        if hasattr(owner, "weight_loader"):
            owner.weight_loader(param, tensor, part)
        else:
            param.data.copy_(tensor)
    except (RuntimeError, ValueError, IndexError) as error:  # a shape that does not fit
        raise ValueError(
            f"weight {name!r} in {file} does not fit the model: {error}"
        ) from None
    return param_name, part


def stored_dtype_fits(tensor: torch.Tensor, param: torch.Tensor) -> bool:
    """An integer or FP8 parameter takes a tensor of its own dtype; another, any float
    but FP8, cast to its dtype."""
    if not param.is_floating_point() or param.dtype.itemsize == 1:
        return tensor.dtype == param.dtype
    return tensor.is_floating_point() and tensor.dtype.itemsize > 1
