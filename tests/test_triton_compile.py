"""Every Triton kernel launch of tests/test_triton_kernels.py (and of LoRA's kernels)
also compiles for an H100
(sm_90), on this machine: the interpreter runs code a GPU build refuses (a loop-carried
value that changes type, an op the backend lacks). The kernel tests run once more under
the interpreter with tests/triton_launches.py recording each launch's types; a process
without the interpreter then compiles each distinct launch to a cubin."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton.backends.nvidia")

TESTS = os.path.dirname(os.path.abspath(__file__))
KERNEL_TESTS = [
    os.path.join(TESTS, "test_triton_kernels.py"),
    os.path.join(
        TESTS, "test_lora.py::test_the_batched_delta_is_each_rows_own_adapter"
    ),
]
COMPILE = """
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

for launch in json.load(open(sys.argv[1])):
    kernel = getattr(importlib.import_module(launch["module"]), launch["name"])
    source = ASTSource(kernel, launch["signature"], launch["constants"])
    compiled = triton.compile(
        source, target=GPUTarget("cuda", 90, 32), options=launch["options"]
    )
    print(launch["module"], launch["name"], len(compiled.asm["cubin"]))
"""


def test_every_kernel_launch_compiles_for_sm90(tmp_path):
    record = tmp_path / "launches.json"
    env = dict(os.environ, TRITON_INTERPRET="1", TRITON_LAUNCHES=str(record))
    env["PYTHONPATH"] = os.pathsep.join([TESTS, env.get("PYTHONPATH", "")])
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "triton_launches"]
        + ["-p", "no:cacheprovider", *KERNEL_TESTS],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:]
    launches = json.loads(record.read_text())
    names = {launch["name"] for launch in launches}
    assert {
        "_sample_row",
        "_prefill_kernel",
        "_decode_kernel",
        "_shrink_kernel",
    } <= names
    env.pop("TRITON_INTERPRET")
    built = subprocess.run(
        [sys.executable, "-c", COMPILE, str(record)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    assert len(built.stdout.splitlines()) == len(launches)
