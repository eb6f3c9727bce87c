"""bench.py runs end to end on CPU (a smoke test: no timing is asserted)."""
import importlib
import json
import os
import sys

import pytest


@pytest.fixture(scope="module")
def bench():
    # importable by name: bench.py runs each engine in a spawned process
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return importlib.import_module("bench")


def test_throughput_with_peers(bench, qwen3_path, tmp_path):
    out = tmp_path / "bench.json"
    result = bench.main(["--tiny", "--model", qwen3_path, "--engines", "nanopaged,hf-static,nano-vllm",
                         "--prefix-len", "16", "--out", str(out), "--plot", str(tmp_path / "bench.png")])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    nano = result["engines"]["nanopaged"]
    assert nano["output_tokens"] == result["workload"]["output_tokens"]
    assert nano["prefix_hit_rate"] > 0 and nano["kv_blocks"] > 0
    assert result["engines"]["hf-static"]["output_tokens"] == result["workload"]["output_tokens"]
    assert "elapsed" in result["engines"]["nano-vllm"] or "skipped" in result["engines"]["nano-vllm"]
    assert result["floor"]["seconds"] > 0
    assert (tmp_path / "bench.png").stat().st_size > 0


def test_step_times(bench, qwen3_path, tmp_path):
    result = bench.main(["--tiny", "--model", qwen3_path, "--steps", "--backends", "torch",
                         "--plot", str(tmp_path / "steps.png")])
    kinds = [row["kind"] for row in result["steps"]]
    assert kinds == ["decode b=1", "decode b=4", "prefill 128 tok"]
    assert all(row["ms"] > 0 and row["floor_ms"] > 0 for row in result["steps"])
    assert (tmp_path / "steps.png").stat().st_size > 0


def test_host_times(bench, qwen3_path):
    result = bench.main(["--tiny", "--model", qwen3_path, "--host"])
    kinds = [row["kind"] for row in result["host"]]
    assert kinds == ["decode b=1 block=16", "decode b=1 block=256",
                     "decode b=4 block=16", "decode b=4 block=256"]
    assert all(row["ms"] > 0 for row in result["host"])
