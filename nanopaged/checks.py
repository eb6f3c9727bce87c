"""Checks of what a user gives, before any of it reaches the engine: the options (a
ValueError names the option, what it must be, and what it got), and the checkpoint's
config (the fields that ask for what the model does not implement)."""

from collections.abc import Callable
from dataclasses import fields
from typing import get_args

LAYER_TYPES = {"full_attention", "sliding_attention"}


def check_fields(options, choices: dict | None = None, positive: tuple = ()) -> None:
    """A ValueError naming the first field of the dataclass `options` whose value has
    not the field's type, is not one of its `choices`, or is below 1 while it should be
    `positive`."""
    for f in filter(lambda f: f.init, fields(options)):
        value = getattr(options, f.name)
        allowed = get_args(f.type) or (f.type,)
        numbers = allowed + ((int,) if float in allowed else ())  # an int is a number
        wrong_bool = isinstance(value, bool) and bool not in allowed
        if wrong_bool or not isinstance(value, numbers):
            names = " or ".join(
                "None" if t is type(None) else "a number" if t is float else t.__name__
                for t in allowed
            )
            raise ValueError(f"{f.name} must be {names}, got {value!r}")
        if f.name in positive and value is not None and value < 1:
            raise ValueError(f"{f.name} must be >= 1, got {value}")
    for name, named in (choices or {}).items():
        value = getattr(options, name)
        if value not in named:
            shown = tuple(choice for choice in named if choice)
            raise ValueError(f"{name} must be one of {shown}, got {value!r}")


def unsupported_fields(config) -> dict:
    """The fields of a Qwen- or Llama-like config that ask for what the core's decoder
    does not do, with their values (a quantization_config is checked apart)."""
    # torch, imported once a model is read
    from nanopaged.core.layers import ROPE_SCALINGS, rope_type
    from nanopaged.core.model import rope_parameters

    ropes = [rope_parameters(config, i) for i in range(config.num_hidden_layers)]
    rope_types = {rope_type(rope) for rope in ropes}
    partial = {
        r.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
        for r in ropes
    } - {1.0}
    act = getattr(config, "hidden_act", "silu")
    found = {
        "hidden_act": act if act != "silu" else None,
        "rope_type": ", ".join(sorted(rope_types - set(ROPE_SCALINGS))) or None,
        "partial_rotary_factor": partial.pop() if partial else None,
        "layer_types": set(getattr(config, "layer_types", None) or ()) - LAYER_TYPES
        or None,
    }
    return {name: value for name, value in found.items() if value is not None}


# architecture -> its own check, for families whose configs have more to refuse (their
# modules enter them); any other architecture gets `unsupported_fields`
UNSUPPORTED: dict[str, Callable[[object], dict]] = {}
