"""The model runner's policies that a GPU would exercise, checked on CPU: which CUDA
graph a decode batch replays, its padding rows, the eager fallback, and the KV budget's
arithmetic."""

import pytest
import torch
from conftest import random_prompts

from nanopaged import LLM, SamplingParams
from nanopaged.core.cuda_graphs import DecodeGraphs


class StandInGraph:
    """What `capture` returns: replays the recorded forward (eagerly), counting its
    replays."""

    def __init__(self, forward, pool):
        self.forward = forward
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        self.forward()

    def pool(self) -> None:
        return None


def decode_step(llm: LLM, batch: int):
    """A decode step of `batch` sequences (prefilled first), and its device inputs."""
    for prompt in random_prompts([5 + i for i in range(batch)], seed=batch):
        llm.add_request(prompt, None)
    while llm.engine.scheduler.waiting:
        llm.run_step()
    step = llm.engine.scheduler.schedule()
    runner = llm.engine.runner
    return step, runner.device_inputs(runner.prepare_inputs(step))


def test_a_decode_batch_replays_the_next_larger_graph_over_padding_rows(
    qwen3_path, monkeypatch
):
    llm = LLM(
        qwen3_path, attention_backend="torch", max_num_seqs=40, num_kvcache_blocks=64
    )
    runner, captured = llm.engine.runner, []

    def capture(forward, pool):
        captured.append(forward)
        return StandInGraph(forward, pool)

    monkeypatch.setattr("nanopaged.core.cuda_graphs.capture_cuda_graph", capture)
    graphs = DecodeGraphs(runner.model, llm.config, runner.max_blocks_per_seq)
    # sizes 1, 2, 4, 8, then steps of 16 up to max_num_seqs; captured largest first
    assert graphs.batch_sizes == [1, 2, 4, 8, 16, 32] and graphs.max_batch == 32
    assert list(graphs.graphs) == [32, 16, 8, 4, 2, 1] and len(captured) == 6
    step, (input_ids, positions, meta) = decode_step(llm, 5)
    eager = runner.model(input_ids, positions, meta)
    hidden = graphs.replay(input_ids, positions, meta)
    assert [size for size, g in graphs.graphs.items() if g.replays] == [8]
    assert torch.allclose(hidden, eager, atol=1e-6)
    # the three padding rows of the 8-graph write no cache slot and see no context
    assert graphs.meta.slot_mapping[5:8].tolist() == [-1] * 3
    assert graphs.meta.context_lens[5:8].tolist() == [0] * 3


def test_a_batch_larger_than_every_graph_runs_eagerly(qwen3_path, monkeypatch):
    llm = LLM(
        qwen3_path, attention_backend="torch", max_num_seqs=40, num_kvcache_blocks=64
    )
    runner = llm.engine.runner
    monkeypatch.setattr("nanopaged.core.cuda_graphs.capture_cuda_graph", StandInGraph)
    runner.graphs = DecodeGraphs(runner.model, llm.config, runner.max_blocks_per_seq)
    step, _ = decode_step(llm, 33)
    runner.execute(runner.prepare_inputs(step))
    assert not any(g.replays for g in runner.graphs.graphs.values())
    for request_id in list(llm.requests):
        llm.abort(request_id)
    step, _ = decode_step(llm, 32)
    runner.execute(runner.prepare_inputs(step))
    assert [size for size, g in runner.graphs.graphs.items() if g.replays] == [32]


def test_a_runner_without_a_feature_that_needs_one_has_no_extension(qwen3_path):
    """A plain engine's runner calls no extension hook: it has none, and its step
    inputs carry nothing of one (LoRA's runner has one: tests/test_lora.py)."""
    llm = LLM(qwen3_path, attention_backend="torch", num_kvcache_blocks=64)
    runner = llm.engine.runner
    assert runner.extension is None
    step, _ = decode_step(llm, 2)
    assert runner.prepare_inputs(step).extension is None


def test_the_gpu_kv_budget_is_what_the_profiling_forward_leaves(
    qwen3_path, monkeypatch
):
    """total x gpu_memory_utilization, less what is in use, less the activations' peak
    of the largest prefill the scheduler can issue (and of sampling the largest
    batch)."""
    llm = LLM(
        qwen3_path,
        max_num_batched_tokens=300,
        max_num_seqs=8,
        max_model_len=256,
        gpu_memory_utilization=0.5,
        attention_backend="torch",
    )
    runner, profiled = llm.engine.runner, []
    gib = 1 << 30
    monkeypatch.setattr(runner, "execute", lambda inputs: profiled.append(inputs))
    for name, value in (
        ("empty_cache", None),
        ("reset_peak_memory_stats", None),
        ("synchronize", None),
        ("mem_get_info", (70 * gib, 80 * gib)),
        ("max_memory_allocated", 7 * gib),
        ("memory_allocated", 5 * gib),
    ):
        monkeypatch.setattr(torch.cuda, name, lambda *args, value=value: value)
    assert runner.kv_budget_cuda() == 80 * gib // 2 - 10 * gib - 2 * gib
    # the profiling forward: one prompt of max_model_len tokens (256 of a 300-token
    # budget)
    assert len(profiled) == 1 and len(profiled[0].input_ids) == 256


def test_flash_decode_leaves_the_windows_right_edge_open(monkeypatch):
    """flash-attn reads a GQA group's K/V once for all its query heads only when the
    window has no right edge: decode passes (-1, -1), or (window - 1, -1), never
    causal's (.., 0)."""
    import sys
    import types

    from nanopaged.core.attention import AttentionMetadata, decode_flash

    calls = []
    fake = types.ModuleType("flash_attn")
    fake.flash_attn_with_kvcache = lambda q, k, v, **options: calls.append(options) or q
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    meta = AttentionMetadata(
        ragged=False,
        slot_mapping=torch.zeros(2, dtype=torch.int64),
        context_lens=torch.tensor([5, 9], dtype=torch.int32),
        block_tables=torch.zeros(2, 1, dtype=torch.int32),
        max_seqlen_k=9,
    )
    q = torch.randn(2, 4, 8)
    for window in (None, 24):
        assert torch.equal(decode_flash(q, None, None, meta, 0.1, window), q)
    assert [c["window_size"] for c in calls] == [(-1, -1), (23, -1)]
    assert not any(c.get("causal") for c in calls)


def test_element_wise_kernels_vary_in_the_token_count_alone(monkeypatch):
    """Off the CPU the fused element-wise functions are compiled with the step's token
    count as their one variable size (a batch of one apart): heads, head size and table
    stay constants, which inductor's kernels need to run at the memory's speed. Traced
    here on meta tensors, each compiled graph recorded with its variable sizes."""
    from nanopaged.core import layers

    graphs = []  # (input shapes, how many sizes the graph takes as variables)

    def record(gm, inputs):
        shapes = [tuple(x.shape) for x in inputs if isinstance(x, torch.Tensor)]
        graphs.append((shapes, sum(isinstance(x, torch.SymInt) for x in inputs)))
        return gm.forward

    compile_ = torch.compile
    monkeypatch.setattr(
        torch, "compile", lambda fn, **kw: compile_(fn, backend=record, **kw)
    )
    torch._dynamo.reset()
    rotary = layers.compiled_on_gpu(layers.apply_rotary, rows=3)
    cos_sin = torch.randn(4096, 128, device="meta")
    try:
        for tokens in (512, 7, 300, 1, 2):
            q, k = (torch.randn(tokens, h, 128, device="meta") for h in (16, 8))
            out = rotary(q, k, torch.arange(tokens, device="meta"), cos_sin)
            assert [t.shape for t in out] == [q.shape, k.shape]
        # on the CPU: as written, nothing compiled
        layers.compiled_on_gpu(layers.rms_norm)(torch.ones(3, 8), torch.ones(8), 1e-6)
    finally:
        torch._dynamo.reset()
    assert graphs == [
        ([(4096, 128), (512,), (512, 16, 128), (512, 8, 128)], 1),  # 7, 300, 2 too
        ([(4096, 128), (1,), (1, 16, 128), (1, 8, 128)], 0),
    ]


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_the_reading_mode_runs_every_layers_attention_on_every_step(
    qwen3_path, monkeypatch, backend
):
    """`enforce_eager=True`: no graphs, so `Attention.forward` (a breakpoint in it) runs
    for every layer on every step; by default a CPU's decode steps replay a graph."""
    from nanopaged.core.attention import Attention

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    counts = {}
    for eager in (True, False):
        llm = LLM(qwen3_path, attention_backend=backend, enforce_eager=eager)
        with monkeypatch.context() as patch:
            calls = counted(patch, Attention, "forward")
            llm.generate(["A block table maps blocks"], params, use_tqdm=False)
        counts[eager] = len(calls)
    layers = llm.config.hf_config.num_hidden_layers
    assert counts[True] == 12 * layers  # one prefill step, eleven decode steps
    # the torch backend has no graphs; the CPU's replay all decode steps but the first
    assert counts[False] == (12 if backend == "torch" else 2) * layers


def counted(patch, owner, name: str) -> list:
    """A list that grows by one at each call of `owner.name` while `patch` holds."""
    calls, original = [], getattr(owner, name)
    patch.setattr(owner, name, lambda *args: calls.append(1) or original(*args))
    return calls
