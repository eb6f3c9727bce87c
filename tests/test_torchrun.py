"""Tensor parallelism under torchrun on CPU (gloo): two "nodes" on one machine, one rank
each, meeting through torchrun's c10d rendezvous on 127.0.0.1, as two machines would."""

import json
import os
import subprocess
import sys

import psutil
import pytest
from conftest import random_prompts

from nanopaged import LLM
from nanopaged.parallel.tensor import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 240

# vLLM's examples/offline_inference/torchrun_example.py, with the import and the model
# changed
TORCHRUN_EXAMPLE = """\
from nanopaged import LLM, SamplingParams

# Create prompts, the same across all ranks
prompts = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]

# Create sampling parameters, the same across all ranks
sampling_params = SamplingParams(temperature=0.8, top_p=0.95)

# Use `distributed_executor_backend="external_launcher"` so that
# this llm engine/instance only creates one worker.
llm = LLM(model={model!r},
          tensor_parallel_size=2,
          distributed_executor_backend="external_launcher",
        )

outputs = llm.generate(prompts, sampling_params)

# all ranks will have the same outputs
for output in outputs:
    prompt = output.prompt
    generated_text = output.outputs[0].text
    print(f"Prompt: {{prompt!r}}, "
          f"Generated text: {{generated_text!r}}")
"""

GREEDY_SCRIPT = """\
import json, os, sys
from nanopaged import LLM, SamplingParams

model, prompts, max_tokens = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
llm = LLM(model, tensor_parallel_size=2,
          distributed_executor_backend="external_launcher",
          max_model_len=256, kvcache_block_size=16, num_kvcache_blocks=12,
          max_num_batched_tokens=48)
greedy = SamplingParams(temperature=0, max_tokens=max_tokens)
for attempt in range(2):
    if attempt and os.environ.get("DIE_ON_RANK") == os.environ["RANK"]:
        os._exit(3)
    outputs = llm.generate(prompts, greedy, use_tqdm=False)
    print("TOKENS", json.dumps([o.outputs[0].token_ids for o in outputs]), flush=True)
print("PREEMPTIONS", llm.stats().num_preemptions)
"""


def torchrun_two_nodes(
    script: str, *args: str, env: dict | None = None
) -> list[subprocess.CompletedProcess]:
    """Runs `script` as two torchrun "nodes" of one process each; returns both
    results."""
    port = free_port()
    nodes = []
    for node_rank in range(2):
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--node-rank",
            str(node_rank),
            "--nproc-per-node",
            "1",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-id",
            "nanopaged-test",
            script,
            *args,
        ]
        nodes.append(
            subprocess.Popen(
                command,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=dict(os.environ, PYTHONPATH=ROOT, **(env or {})),
            )
        )
    results = []
    try:
        for node in nodes:
            stdout, stderr = node.communicate(timeout=TIMEOUT_S)
            results.append(
                subprocess.CompletedProcess(node.args, node.returncode, stdout, stderr)
            )
        left_behind = _running(script)
    finally:
        for process in [*_running(script), *(p for node in nodes for p in _tree(node))]:
            process.kill()
    assert not left_behind, "a rank outlived its torchrun"
    return results


def _running(script: str) -> list[psutil.Process]:
    def runs_script(process: psutil.Process) -> bool:
        try:
            return script in process.cmdline()
        except psutil.Error:
            return False

    return [p for p in psutil.process_iter() if runs_script(p)]


def _tree(node: subprocess.Popen) -> list[psutil.Process]:
    try:
        parent = psutil.Process(node.pid)
        return parent.children(recursive=True) + [parent]
    except psutil.NoSuchProcess:
        return []


def test_two_nodes_give_transformers_greedy_tokens(qwen3_path, tmp_path, hf_greedy):
    """Across two nodes, with chunked prompts and preemption (12 blocks of 16 tokens),
    both ranks return transformers' tokens, twice."""
    prompts = random_prompts([30, 60, 12, 45], seed=20)
    expected = hf_greedy(qwen3_path, prompts, 30)
    (tmp_path / "greedy.py").write_text(GREEDY_SCRIPT)
    results = torchrun_two_nodes(
        str(tmp_path / "greedy.py"), qwen3_path, json.dumps(prompts), "30"
    )
    for result in results:
        assert result.returncode == 0, result.stderr[-3000:]
        tokens = [
            json.loads(line[len("TOKENS ") :])
            for line in result.stdout.splitlines()
            if line.startswith("TOKENS ")
        ]
        assert tokens == [expected, expected]
        assert int(result.stdout.split("PREEMPTIONS ")[1]) > 0


def test_vllms_torchrun_example_runs_with_the_import_and_model_changed(
    qwen3_path, tmp_path
):
    (tmp_path / "torchrun_example.py").write_text(
        TORCHRUN_EXAMPLE.format(model=qwen3_path)
    )
    results = torchrun_two_nodes(str(tmp_path / "torchrun_example.py"))
    for result in results:
        assert result.returncode == 0, result.stderr[-3000:]
    lines = [
        [line for line in r.stdout.splitlines() if line.startswith("Prompt: ")]
        for r in results
    ]
    # sampled, the same on every rank
    assert len(lines[0]) == 4 and lines[0] == lines[1]
    assert "Prompt: 'The capital of France is', Generated text: " in lines[0][2]


def test_a_rank_that_dies_makes_the_other_exit_with_an_error(qwen3_path, tmp_path):
    (tmp_path / "greedy.py").write_text(GREEDY_SCRIPT)
    prompts = json.dumps(random_prompts([20, 30], seed=21))
    results = torchrun_two_nodes(
        str(tmp_path / "greedy.py"), qwen3_path, prompts, "20", env={"DIE_ON_RANK": "1"}
    )
    assert all(r.returncode != 0 for r in results)
    survivor = results[0]
    # the first generate, before rank 1 died
    assert survivor.stdout.count("TOKENS ") == 1
    assert "Error" in survivor.stderr


def test_external_launcher_outside_torchrun_is_an_error(qwen3_path, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="runs under torchrun, which sets RANK"):
        LLM(
            qwen3_path,
            tensor_parallel_size=2,
            distributed_executor_backend="external_launcher",
        )
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    with pytest.raises(
        ValueError, match="torchrun started 4 processes.*tensor_parallel_size=2"
    ):
        LLM(
            qwen3_path,
            tensor_parallel_size=2,
            distributed_executor_backend="external_launcher",
        )
    with pytest.raises(ValueError, match="distributed_executor_backend must be one of"):
        LLM(qwen3_path, distributed_executor_backend="ray")
