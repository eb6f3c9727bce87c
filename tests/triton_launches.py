"""A pytest plugin for tests/test_triton_compile.py: under TRITON_INTERPRET=1, writes to
$TRITON_LAUNCHES (JSON) each kernel launch's argument types and constant values, as
Triton would specialize them for a GPU build."""

import atexit
import inspect
import json
import os

import torch
from triton.runtime.interpreter import InterpretedFunction

TYPES = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float8_e4m3fn: "fp8e4nv",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "i1",
}
OPTIONS = ("num_warps", "num_stages")
launches: dict[str, dict] = {}


def _kind(value) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    return "fp32"


def describe(kernel: InterpretedFunction, args: tuple, kwargs: dict) -> dict:
    """The launch as `triton.compile` takes it: the signature, the constants (a
    parameter marked constexpr, None, or an int equal to 1 that Triton specializes),
    the options."""
    parameters = inspect.signature(kernel.fn).parameters
    values = dict(zip(kernel.arg_names, args))
    values.update({k: v for k, v in kwargs.items() if k not in OPTIONS})
    keep = set(kernel.kwargs.get("do_not_specialize") or ())
    signature, constants = {}, {}
    for name, value in values.items():
        marked = "constexpr" in str(parameters[name].annotation)
        one = _kind(value) == "i32" and value == 1
        if marked or value is None or one:
            if not (name in keep and not marked and value is not None):
                signature[name], constants[name] = "constexpr", value
                continue
        signature[name] = _kind(value)
    return dict(
        module=kernel.fn.__module__,
        name=kernel.fn.__name__,
        signature=signature,
        constants=constants,
        options={k: kwargs[k] for k in OPTIONS if k in kwargs},
    )


def _recording_run(self, *args, grid, warmup, **kwargs):
    launch = describe(self, args, kwargs)
    launches[json.dumps(launch, sort_keys=True)] = launch
    return _run(self, *args, grid=grid, warmup=warmup, **kwargs)


_run = InterpretedFunction.run
InterpretedFunction.run = _recording_run


@atexit.register
def _write() -> None:
    with open(os.environ["TRITON_LAUNCHES"], "w") as f:
        json.dump(list(launches.values()), f)
