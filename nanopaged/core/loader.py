"""Loads (sharded) safetensors checkpoints into the model's packed layout."""
import glob
import os

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from transformers import PretrainedConfig

from nanopaged.core.attention import BACKENDS
from nanopaged.core.layers import QUANTIZATIONS, LinearMethod, linear_methods
from nanopaged.core.model import ARCHITECTURES

# Checkpoint tensors the model has no parameter for, by design.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_model(path: str, hf_config: PretrainedConfig, dtype: torch.dtype, device: torch.device,
               attention_backend: str) -> nn.Module:
    """The model of the checkpoint at `path` (its config `hf_config`, checked by
    `check_supported`), built in `dtype` on `device`, quantized as `quantization_config` says."""
    architecture = next(a for a in hf_config.architectures if a in ARCHITECTURES)
    backend = BACKENDS[attention_backend]
    linear = backend.linear() if backend.linear else LinearMethod()
    quant = getattr(hf_config, "quantization_config", None)
    projections = QUANTIZATIONS[quant["quant_method"]](quant, linear) if quant else linear
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device, linear_methods(projections, linear):
            model = ARCHITECTURES[architecture](hf_config, attention_backend)
    finally:
        torch.set_default_dtype(default_dtype)
    load_weights(model, path)
    for module in model.modules():
        if isinstance(getattr(module, "method", None), LinearMethod):
            module.method.process_weights(module)
    return model


def load_weights(model: nn.Module, path: str) -> None:
    """Copies every tensor of the checkpoint at `path` into the parameter (and part: q/k/v,
    gate/up, an expert's) `model.checkpoint_param` names, through its module's `weight_loader`
    if it has one. A tensor with no parameter, or a part no tensor filled, is a ValueError."""
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in {path!r}")
    params = dict(model.named_parameters(remove_duplicate=False))
    modules = dict(model.named_modules())
    tied = getattr(model, "tie_word_embeddings", False)
    unfilled = {(name, part) for name in params if not (tied and name == "lm_head.weight")
                for part in model.param_parts(name)}
    for file in files:
        try:
            with safe_open(file, "pt", "cpu") as f:
                for name in f.keys():
                    if not (name.endswith(IGNORED_SUFFIXES) or tied and name == "lm_head.weight"):
                        unfilled.discard(_load_tensor(model, params, modules, name, f, file))
        except SafetensorError as error:
            raise ValueError(f"cannot read {file}: {error} (a truncated download?)") from None
    if unfilled:
        missing = sorted(name + ("" if shard is None else f" (part {shard})")
                         for name, shard in unfilled)
        raise ValueError(f"checkpoint {path!r} is missing weights: {', '.join(missing)}")


def _load_tensor(model: nn.Module, params: dict, modules: dict, name: str, f, file: str
                 ) -> tuple[str, str | int | None]:
    """Loads the checkpoint tensor `name` into its parameter; returns (parameter, part)."""
    param_name, shard = model.checkpoint_param(name)
    if param_name not in params:
        raise ValueError(f"unexpected weight {name!r} in {file}")
    owner = modules[param_name.rpartition(".")[0]]
    load = getattr(owner, "weight_loader", None)
    try:
        if load is None:
            params[param_name].data.copy_(f.get_tensor(name))
        else:
            load(params[param_name], f.get_tensor(name), shard)
    except (RuntimeError, ValueError) as error:  # a shape that does not fit the config
        raise ValueError(f"weight {name!r} in {file} does not fit the model: {error}") from None
    return param_name, shard
