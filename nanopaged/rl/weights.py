"""New weights in place, on one rank: a trainer's `(name, tensor)` pairs copied into the
running engine's model, every pair checked before any is copied, and a Ctrl-C during the
copy finishing it first: the model holds the old weights or the new ones, never a mix.

Names and shapes are the checkpoint's, which are transformers': a pair named
`model.layers.0.self_attn.q_proj.weight` lands in its part of the fused q/k/v
projection, as the loader puts it there (`core/loader.py`, through the layer's
`weight_loader`), and each tensor-parallel rank takes its own shard. A name is known
by the parameter it fills (the model's `checkpoint_param`), so a vision-language model
takes both the names its checkpoint was published with (`visual.`, `model.layers.`) and
those of transformers' model, which a trainer sends (`model.visual.`,
`model.language_model.layers.`). An LM head tied to
the embedding is the embedding: its pair, if sent, is the embedding's and is skipped.

A layer whose method packed its weight at load time (the CPU backend's panels, oneDNN's
layout) gives it back unpacked (`dense_weight`), takes the new parts, and is packed
again into the same memory (`set_dense_weight`). So is a packed copy of a weight that
also stays plain (the CPU's LM head). Everything is written where it lay: CUDA graphs
and the CPU's step graphs, which read the weights in place, stay valid.
"""

import glob
import os
from collections.abc import Iterable

import torch
from safetensors import safe_open
from torch import nn

from nanopaged.core.layers import parameter
from nanopaged.core.loader import IGNORED_SUFFIXES

# what a pair's name holds when it is a LoRA adapter's, not the base model's
LORA_NAMES = (".lora_A.", ".lora_B.", ".lora_embedding_")


def checkpoint_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """Every tensor's name in the checkpoint at `path` -> its shape (from the files'
    headers: nothing is read but them)."""
    shapes = {}
    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        with safe_open(file, "pt", "cpu") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def packing_method(module: nn.Module):
    """The method of `module` that keeps its weight packed (under a feature's wrapper,
    LoRA's `base`), or None."""
    method = getattr(module, "method", None)
    while hasattr(method, "base"):
        method = method.base
    return method if hasattr(method, "set_dense_weight") else None


class WeightWriter:
    """Writes new weights into one rank's model (`model` of a runner built from the
    checkpoint `path`); `writes` counts the batches it wrote."""

    def __init__(self, model: nn.Module, hf_config, path: str):
        self.model = model
        self.quantization = getattr(hf_config, "quantization_config", None)
        self.tied = getattr(model, "tie_word_embeddings", False)
        self.path = path
        self.shapes: dict[str, tuple[int, ...]] | None = None  # read at first need
        self.names: dict[tuple, str] = {}  # the parameter (and part) -> its name there
        self.writes = 0

    def read_shapes(self) -> dict[str, tuple[int, ...]]:
        if self.shapes is None:
            self.shapes = checkpoint_shapes(self.path)
            self.names = {self.model.checkpoint_param(n): n for n in self.shapes}
        return self.shapes

    def checkpoint_name(self, name: str) -> str | None:
        """The checkpoint's name of the tensor a pair named `name` is, or None."""
        self.read_shapes()
        return self.names.get(self.model.checkpoint_param(name))

    def check(self, weights: Iterable) -> list[tuple[str, torch.Tensor]]:
        """The pairs of `weights`, as a list, once every one is known to fit; else a
        ValueError that names each that does not (and nothing is written)."""
        weights = list(weights)
        if self.quantization is not None:
            raise ValueError(
                f"this model is quantized ({self.quantization.get('quant_method')}): "
                f"its weights cannot be replaced in place; load the new checkpoint in "
                f"a new engine"
            )
        self.read_shapes()
        problems = [p for pair in weights if (p := self._problem(pair)) is not None]
        if problems:
            more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
            raise ValueError(
                "new weights refused, none written: " + "; ".join(problems[:5]) + more
            )
        return weights

    def expected_names(self) -> set[str]:
        """The checkpoint's names of every weight the model takes (a tied LM head's
        apart)."""
        shapes = self.read_shapes()
        names = {name for name in shapes if not name.endswith(IGNORED_SUFFIXES)}
        return names - ({"lm_head.weight"} if self.tied else set())

    def _problem(self, pair) -> str | None:
        """What is wrong with one pair, or None."""
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
            return f"{pair!r} is not a (name, tensor) pair"
        name, tensor = pair
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            return f"({name!r}, {type(tensor).__name__}) is not a (name, tensor) pair"
        if any(part in name for part in LORA_NAMES):
            return (
                f"{name!r} is a LoRA adapter's weight: new weights replace the base "
                f"model's, and the adapters stay as they were loaded"
            )
        if self.tied and name == "lm_head.weight":
            return None  # the embedding's
        known = self.checkpoint_name(name)
        if known is None:
            return (
                f"{name!r} is no weight of this checkpoint (its names are "
                f"transformers', such as {next(iter(self.shapes))!r})"
            )
        if tuple(tensor.shape) != self.shapes[known]:
            return (
                f"{name!r} has shape {tuple(tensor.shape)}, the checkpoint's "
                f"{self.shapes[known]}"
            )
        if not tensor.is_floating_point() or tensor.dtype.itemsize == 1:
            return f"{name!r} is {tensor.dtype}: a float16, bfloat16 or float32 tensor"
        return None

    def write(self, weights: Iterable) -> set[str]:
        """Checks `weights`, then copies them into the model; returns their names."""
        weights = self.check(weights)
        groups: dict[str, list] = {}
        for name, tensor in weights:
            skipped = (
                name.endswith(IGNORED_SUFFIXES)
                or self.tied
                and name == "lm_head.weight"
            )
            if not skipped:
                param_name, part = self.model.checkpoint_param(name)
                groups.setdefault(param_name, []).append((part, tensor))
        groups = list(groups.items())
        done = 0
        try:
            for param_name, parts in groups:
                self._write(param_name, parts)
                done += 1
        except KeyboardInterrupt:
            # each parameter's write is whole and can be done again: finish them all
            for param_name, parts in groups[done:]:
                self._write(param_name, parts)
            raise
        finally:
            self.writes += 1
        return {name for name, _ in weights}

    def _write(self, param_name: str, parts: list) -> None:
        """Writes one parameter's parts (those of its tensor-parallel shard) where its
        values lie: the parameter itself, or the packed weight its method keeps."""
        owner_name, _, leaf = param_name.rpartition(".")
        owner = self.model.get_submodule(owner_name)
        live = getattr(owner, leaf, None)
        method = packing_method(owner)
        # a freed plain weight: the method's packed one, unpacked for the writing
        target = (
            live if live is not None else parameter(method.dense_weight(owner), 0, 1)
        )
        loader = getattr(owner, "weight_loader", None)
        for part, tensor in parts:
            if loader is None:
                target.data.copy_(tensor)
            else:
                loader(target, tensor, part)
        if live is None:
            method.set_dense_weight(owner, target.data)
            return
        for module in self.model.modules():  # a packed copy of it (an LM head's)
            method = packing_method(module)
            if method is not None and getattr(module, "weight", None) is live:
                method.set_dense_weight(module, live.data)
