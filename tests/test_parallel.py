"""Tensor parallelism on CPU (gloo): two ranks give the tokens of one, and leave no
process behind."""

import gc
import itertools
import os
import re
import socket
import subprocess
import sys
import time

import psutil
import pytest
import torch
from conftest import ARCHITECTURES, random_prompts

from nanopaged import LLM, SamplingParams
from nanopaged.core.config import Config
from nanopaged.parallel.tensor import ParallelConfig, free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

GREEDY = SamplingParams(temperature=0, max_tokens=40)


def worker_processes() -> list[psutil.Process]:
    """This process's tensor-parallel workers (multiprocessing's resource tracker
    excluded)."""
    return [
        p
        for p in psutil.Process().children(recursive=True)
        if "resource_tracker" not in " ".join(p.cmdline())
    ]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_two_ranks_match_transformers_with_prefix_hits_and_preemption(
    arch, model_path, hf_greedy
):
    path = model_path(arch)
    shared = random_prompts([40], seed=10)[0]
    prompts = [shared + tail for tail in random_prompts([3, 20, 9], seed=11)]
    prompts += random_prompts([30, 60, 12], seed=12)
    expected = hf_greedy(path, prompts, GREEDY.max_tokens)
    # 14 blocks of 16 tokens cannot hold six sequences of 50-100 tokens at once; a
    # budget of 48 tokens a step prefills the longer prompts in chunks
    with LLM(
        path,
        max_model_len=512,
        tensor_parallel_size=2,
        kvcache_block_size=16,
        num_kvcache_blocks=14,
        max_num_batched_tokens=48,
    ) as llm:
        first = llm.generate(prompts, GREEDY, use_tqdm=False)
        second = llm.generate(prompts[:3], GREEDY, use_tqdm=False)
        assert llm.engine.scheduler.num_preemptions > 0
    # the shared 40 tokens fill two whole blocks, computed once
    assert [o.num_cached_tokens for o in first][:3] == [0, 32, 32]
    assert [o.num_cached_tokens for o in second] == [0, 32, 32]
    assert [o.outputs[0].token_ids for o in first] == expected
    assert [o.outputs[0].token_ids for o in second] == expected[:3]
    assert not worker_processes()


def test_garbage_collected_engine_stops_its_workers(qwen3_path, hf_greedy):
    llm = LLM(
        qwen3_path,
        max_model_len=256,
        tensor_parallel_size=2,
        distributed_port=free_port(),
    )
    [worker] = worker_processes()
    [out] = llm.generate(
        [[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False
    )
    assert out.outputs[0].token_ids == hf_greedy(qwen3_path, [[5, 6, 7]], 4)[0]
    del llm
    gc.collect()
    worker.wait(timeout=30)
    assert not worker_processes()


def test_one_tensor_parallel_engine_per_process(qwen3_path, hf_greedy):
    with LLM(qwen3_path, max_model_len=256, tensor_parallel_size=2) as llm:
        with pytest.raises(RuntimeError, match="close that engine"):
            LLM(qwen3_path, max_model_len=256, tensor_parallel_size=2)
        assert len(worker_processes()) == 1
        [out] = llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
        assert (
            out.outputs[0].token_ids
            == hf_greedy(qwen3_path, [[5, 6, 7]], GREEDY.max_tokens)[0]
        )


def test_a_closed_engine_refuses_at_once_while_another_is_open(qwen3_path, hf_greedy):
    closed = LLM(qwen3_path, max_model_len=256, tensor_parallel_size=2)
    closed.close()
    with LLM(qwen3_path, max_model_len=256, tensor_parallel_size=2) as llm:
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="the engine is closed"):
            closed.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
        assert time.monotonic() - start < 1
        [out] = llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
        assert (
            out.outputs[0].token_ids
            == hf_greedy(qwen3_path, [[5, 6, 7]], GREEDY.max_tokens)[0]
        )
    assert not worker_processes()


def test_after_a_failed_start_the_next_engine_starts(qwen3_path, hf_greedy):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(
            ValueError, match="cannot listen on 127.0.0.1:.*distributed_port"
        ):
            LLM(
                qwen3_path,
                max_model_len=256,
                tensor_parallel_size=2,
                distributed_port=taken.getsockname()[1],
            )
    assert not worker_processes()
    with LLM(qwen3_path, max_model_len=256, tensor_parallel_size=2) as llm:
        [out] = llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    assert (
        out.outputs[0].token_ids
        == hf_greedy(qwen3_path, [[5, 6, 7]], GREEDY.max_tokens)[0]
    )


def failing_worker(config, parallel, rank, extension):
    """Stands in for the worker's code: fails as a missing module would."""
    raise ImportError("No module named 'flash_attn_2_cuda'")


def test_a_worker_failing_at_start_raises_its_error_at_once(qwen3_path, monkeypatch):
    monkeypatch.setattr("nanopaged.parallel.tensor.run_worker", failing_worker)
    start = time.monotonic()
    with pytest.raises(
        RuntimeError,
        match="(?s)worker nanopaged-tp1 died.*ImportError: "
        "No module named 'flash_attn_2_cuda'",
    ):
        LLM(qwen3_path, max_model_len=256, tensor_parallel_size=2)
    assert time.monotonic() - start < 60 and not worker_processes()


UNGUARDED = (
    "from nanopaged import LLM, SamplingParams\nllm = LLM({path!r}, "
    "max_model_len=256, tensor_parallel_size=2)\n[output] = llm.generate([[5, 6, 7]], "
    "SamplingParams(temperature=0, "
    "max_tokens=8))\nprint(output.outputs[0].token_ids)\n"
)


@pytest.mark.parametrize("how", ["file", "stdin"])
def test_a_script_that_creates_the_engine_at_module_level_runs(
    qwen3_path, tmp_path, hf_greedy, how
):
    """As vLLM's basic example: the workers are forked, so the script is not imported
    again."""
    script = UNGUARDED.format(path=qwen3_path)
    (tmp_path / "script.py").write_text(script)
    command = (
        [sys.executable, str(tmp_path / "script.py")]
        if how == "file"
        else [sys.executable, "-"]
    )
    result = subprocess.run(
        command,
        input=script if how == "stdin" else None,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == str(hf_greedy(qwen3_path, [[5, 6, 7]], 8)[0])


@pytest.mark.parametrize(
    "how, message",
    [
        ("file", 'died .* before nanopaged ran in it.*if __name__ == "__main__"'),
        ("stdin", "'<stdin>' is not a file they can import"),
    ],
)
def test_spawned_workers_need_a_script_they_can_import(
    qwen3_path, tmp_path, how, message
):
    """Spawned (as after CUDA was initialised; here asked for as vLLM's variable asks),
    a worker imports the script again: unguarded, or not a file, it fails at once with a
    clear error."""
    script = UNGUARDED.format(path=qwen3_path)
    (tmp_path / "script.py").write_text(script)
    command = (
        [sys.executable, str(tmp_path / "script.py")]
        if how == "file"
        else [sys.executable, "-"]
    )
    env = dict(os.environ, PYTHONPATH=ROOT, VLLM_WORKER_MULTIPROC_METHOD="spawn")
    result = subprocess.run(
        command,
        input=script if how == "stdin" else None,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode != 0 and "[" not in result.stdout
    assert re.search(message, result.stderr), result.stderr[-2000:]


def test_a_dead_worker_is_an_error_not_a_hang(qwen3_path):
    llm = LLM(qwen3_path, max_model_len=512, tensor_parallel_size=2)
    [worker] = llm.engine.runner.workers
    execute, steps = llm.engine.runner.execute, itertools.count()

    def execute_killing_the_worker(inputs, pending=None):
        # after rank 0 sent the step, before the step's collectives
        if next(steps) == 5:
            worker.kill()
            worker.join()
        return execute(inputs, pending)

    llm.engine.runner.execute = execute_killing_the_worker
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with pytest.raises(RuntimeError, match="worker nanopaged-tp1 died"):
        llm.generate(random_prompts([20] * 4, seed=13), params, use_tqdm=False)
    with pytest.raises(RuntimeError, match="cannot run any more"):
        llm.generate([[5, 6, 7]], params, use_tqdm=False)
    llm.close()
    assert not worker_processes()


def test_a_step_failing_on_rank_0_stops_the_workers(qwen3_path):
    """Rank 0 fails mid-step: the workers may be anywhere in it, so they must not run
    on."""
    llm = LLM(qwen3_path, max_model_len=256, tensor_parallel_size=2)
    [worker] = worker_processes()

    def failing_logits(hidden):
        raise RuntimeError("logits failed")

    llm.engine.runner.model.compute_logits = failing_logits
    with pytest.raises(RuntimeError, match="logits failed"):
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    assert not worker.is_running()
    with pytest.raises(RuntimeError, match="cannot run any more"):
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    llm.close()
    assert not worker_processes()


def test_experts_that_the_ranks_cannot_split_evenly_are_refused(model_path, tmp_path):
    """Each rank takes its share of every expert's intermediate size: 33 cannot be
    halved."""
    from test_errors import broken_copy

    odd = broken_copy(model_path("qwen3-moe"), tmp_path, {"moe_intermediate_size": 33})
    with pytest.raises(
        ValueError,
        match="moe_intermediate_size=33 is not divisible by tensor_parallel_size=2",
    ):
        ParallelConfig(tensor_parallel_size=2).check(Config(odd))
    # 32 can
    ParallelConfig(tensor_parallel_size=2).check(Config(model_path("qwen3-moe")))


def test_tensor_parallel_errors(qwen3_path, monkeypatch):
    config = Config(qwen3_path)
    with pytest.raises(ValueError, match="num_attention_heads=4 is not divisible"):
        ParallelConfig(tensor_parallel_size=3).check(config)
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        LLM(qwen3_path, tensor_parallel_size=0)
    with pytest.raises(ValueError, match="distributed_port"):
        ParallelConfig(tensor_parallel_size=2, distributed_port=70000)
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 1)
    on_gpu = Config(
        qwen3_path, device="cuda", dtype=torch.bfloat16, attention_backend="torch"
    )
    with pytest.raises(ValueError, match="only 1 CUDA GPU"):
        ParallelConfig(tensor_parallel_size=2).check(on_gpu)
