"""Loads (sharded) safetensors checkpoints into the model's packed layout."""
import glob
import os

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from transformers import PretrainedConfig

from nanopaged.core.model import ARCHITECTURES

# Checkpoint tensors the model has no parameter for, by design.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_model(path: str, hf_config: PretrainedConfig, dtype: torch.dtype, device: torch.device,
               attention_backend: str) -> nn.Module:
    """The model of the checkpoint at `path` (its config `hf_config`, checked by
    `check_supported`), built in `dtype` on `device`."""
    architecture = next(a for a in hf_config.architectures if a in ARCHITECTURES)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            model = ARCHITECTURES[architecture](hf_config, attention_backend)
    finally:
        torch.set_default_dtype(default_dtype)
    load_weights(model, path)
    return model


def load_weights(model: nn.Module, path: str) -> None:
    """Copies every tensor of the checkpoint at `path` into `model`.

    q/k/v and gate/up projections are packed into one parameter each (`model.packed_modules`).
    A checkpoint tensor with no parameter, or a parameter no tensor filled, is an error naming it.
    """
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in {path!r}")
    params = dict(model.named_parameters(remove_duplicate=False))
    tied = getattr(model, "tie_word_embeddings", False)
    unfilled = set(params) - ({"lm_head.weight"} if tied else set())
    for file in files:
        try:
            _load_file(model, file, params, unfilled, tied)
        except SafetensorError as error:
            raise ValueError(f"cannot read {file}: {error} (a truncated download?)") from None
    missing = sorted(unfilled | _incomplete_packs(params))
    if missing:
        raise ValueError(f"checkpoint {path!r} is missing weights: {', '.join(missing)}")


def _load_file(model: nn.Module, file: str, params: dict[str, nn.Parameter], unfilled: set[str],
               tied: bool) -> None:
    with safe_open(file, "pt", "cpu") as f:
        for name in f.keys():
            if name.endswith(IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
                continue
            param_name, shard_id = _packed_name(model, name)
            if param_name not in params:
                raise ValueError(f"unexpected weight {name!r} in {file}")
            param = params[param_name]
            loader = getattr(param, "weight_loader", None) or (lambda p, w: p.data.copy_(w))
            try:
                loader(param, f.get_tensor(name), *([] if shard_id is None else [shard_id]))
            except RuntimeError as error:  # a shape that does not fit the config
                raise ValueError(f"weight {name!r} in {file} does not fit the model: "
                                 f"{error}") from None
            unfilled.discard(param_name)
            if shard_id is not None:
                param.loaded_shards = getattr(param, "loaded_shards", set()) | {shard_id}


def _packed_name(model: nn.Module, name: str) -> tuple[str, str | int | None]:
    for fragment, (packed, shard_id) in model.packed_modules.items():
        if f".{fragment}." in name:
            return name.replace(fragment, packed), shard_id
    return name, None


def _incomplete_packs(params: dict[str, nn.Parameter]) -> set[str]:
    """Packed parameters some of whose parts (say v_proj) the checkpoint lacked."""
    incomplete = set()
    for name, param in params.items():
        if hasattr(param, "loaded_shards"):
            expected = {"q", "k", "v"} if "qkv_proj" in name else {0, 1}
            if param.loaded_shards != expected:
                incomplete.add(f"{name} (parts {sorted(map(str, expected - param.loaded_shards))})")
            del param.loaded_shards
    return incomplete
