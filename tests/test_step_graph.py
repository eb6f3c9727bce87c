"""The CPU backend's step graphs (nanopaged/cpu/step_graph.py): a decode forward
captured once per batch size, replayed as its C calls and operators on new inputs."""

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from conftest import random_prompts
from torch import nn

from nanopaged import LLM, SamplingParams
from nanopaged.core.attention import AttentionMetadata
from nanopaged.core.layers import LinearMethod
from nanopaged.cpu import kernels
from nanopaged.cpu.step_graph import StepGraph, StepGraphs, run_operator

pytestmark = pytest.mark.skipif(kernels.library() is None, reason="no C compiler")


class Toy(nn.Module):
    """A forward of the shape a decode step has: an embedding and element-wise
    operators in PyTorch, a norm and a matmul in C; `read_a_value` makes it read a
    tensor's value in Python, which a replay cannot repeat."""

    def __init__(self, read_a_value: bool = False, scale: torch.Tensor | None = None):
        super().__init__()
        self.scale = 1 if scale is None else scale
        g = torch.Generator().manual_seed(0)
        with torch.inference_mode(False):  # as an engine loads its weights
            self.embedding = torch.randn(50, 32, generator=g)
            self.weight = torch.rand(32, generator=g) + 0.5
            self.panels = kernels.pack_panels(torch.randn(48, 32, generator=g))
        self.read_a_value = read_a_value

    def forward(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        h = F.embedding(input_ids, self.embedding) * (positions[:, None] + self.scale)
        if self.read_a_value:
            h = h * float(meta.context_lens.max())
        h = kernels.rms_norm(h, self.weight, 1e-6)
        return kernels.panel_matmul(h, self.panels).add_(h.sum(-1, keepdim=True))


def step(n: int, seed: int) -> tuple:
    g = torch.Generator().manual_seed(seed)
    meta = AttentionMetadata(
        ragged=False,
        slot_mapping=torch.randint(0, 64, (n,), generator=g),
        context_lens=torch.randint(1, 64, (n,), generator=g, dtype=torch.int32),
        block_tables=torch.randint(0, 4, (n, 4), generator=g, dtype=torch.int32),
        max_seqlen_k=64,
    )
    ids = torch.randint(0, 50, (n,), generator=g)
    return ids, torch.randint(0, 64, (n,), generator=g), meta


def toy_graphs(model: nn.Module) -> StepGraphs:
    """Graphs of `model`, built as an engine's are, outside inference mode (the tests
    then run in it, as an engine's steps do)."""
    config = SimpleNamespace(max_num_seqs=8, max_model_len=64)
    with torch.inference_mode(False):
        return StepGraphs(model, config, 4, methods=(LinearMethod,))


def replays_the_forward(graphs: StepGraphs, model: nn.Module, inputs: tuple) -> bool:
    """Whether a replay gives the forward of `inputs`: bit for bit that of the rows it
    ran, padding included (how many rows a matmul multiplies changes its rounding),
    and so that of `inputs` alone up to rounding."""
    n, replayed = len(inputs[0]), graphs.replay(*inputs)
    size = next(size for size in graphs.sizes if size >= n)
    padded = model(*graphs.inputs(size))[:n]
    alone = model(*inputs)
    return torch.equal(replayed, padded) and torch.allclose(replayed, alone, 1e-5, 1e-5)


@torch.inference_mode()
def test_a_replay_computes_the_forward_of_new_inputs():
    model = Toy()
    graphs = toy_graphs(model)
    for seed, n in enumerate([3, 3, 5, 3, 5, 1]):
        inputs = step(n, seed)
        assert replays_the_forward(graphs, model, inputs)
    assert all(graph is not None for graph in graphs.graphs.values())
    assert sorted(graphs.graphs) == [1, 4, 8]  # the next larger sizes: 3 and 5 pad


@torch.inference_mode()
def test_a_forward_that_reads_a_value_runs_eagerly_at_that_size():
    model = Toy(read_a_value=True)
    graphs = toy_graphs(model)
    for seed in range(3):
        inputs = step(4, seed)
        assert torch.equal(graphs.replay(*inputs), model(*inputs))
    assert graphs.graphs == {4: None}


@torch.inference_mode()
def test_an_operator_on_an_inference_tensor_runs_eagerly():
    """PyTorch hides some operators on inference tensors from a dispatch mode (`.to`):
    a forward that computes with one is not captured."""
    model = Toy(scale=torch.tensor(2.0))  # made in inference mode: an inference tensor
    graphs = toy_graphs(model)
    inputs = step(2, 0)
    assert torch.equal(graphs.replay(*inputs), model(*inputs))
    assert graphs.graphs == {2: None}


@torch.inference_mode()
def test_a_graph_whose_replay_differs_from_its_capture_is_not_kept(monkeypatch):
    bind = StepGraph.bind
    monkeypatch.setattr(StepGraph, "bind", lambda *args: bind(*args)[1:])  # no lookup
    model = Toy()
    graphs = toy_graphs(model)
    for seed in range(2):
        inputs = step(3, seed)
        assert torch.equal(graphs.replay(*inputs), model(*inputs))
    assert graphs.graphs == {4: None}


def test_a_model_with_a_linear_method_of_another_feature_has_no_graphs(qwen3_path):
    class Other(LinearMethod):
        pass

    model = Toy()
    model.proj = nn.Module()
    model.proj.method = Other()
    assert toy_graphs(model).max_batch == 0
    lora = LLM(qwen3_path, enable_lora=True, max_loras=1, max_lora_rank=8)
    assert lora.engine.runner.graphs.max_batch == 0


@torch.inference_mode()
def test_the_kernels_take_the_thread_count_the_program_sets_later():
    model, threads = Toy(), torch.get_num_threads()
    graphs = toy_graphs(model)
    graphs.replay(*step(3, 0))
    try:
        torch.set_num_threads(1)
        inputs = step(3, 1)
        assert replays_the_forward(graphs, model, inputs)
        graph = graphs.graphs[4]
        c_calls = [call for call in graph.calls if call.func is not run_operator]
        assert graph.bound[1] == 1 and c_calls
        assert all(call.args[-1] == 1 for call in c_calls)
    finally:
        torch.set_num_threads(threads)


@torch.inference_mode()
def test_ctrl_c_while_capturing_leaves_no_graph_and_no_recording(monkeypatch):
    model = Toy()
    graphs = toy_graphs(model)
    real_run = kernels.run

    def interrupted(kernel, *args):
        if kernels.CAPTURE.get() is not None:
            raise KeyboardInterrupt
        return real_run(kernel, *args)

    monkeypatch.setattr(kernels, "run", interrupted)
    with pytest.raises(KeyboardInterrupt):
        graphs.replay(*step(3, 0))
    assert kernels.CAPTURE.get() is None and graphs.graphs == {}
    monkeypatch.setattr(kernels, "run", real_run)
    inputs = step(3, 1)
    assert replays_the_forward(graphs, model, inputs)


def generated(path: str, eager: bool) -> tuple[list, LLM]:
    prompts = random_prompts([5, 40, 70, 9, 300, 17], seed=3)
    params = [
        SamplingParams(temperature=0.8, seed=i, max_tokens=8 + 5 * i) for i in range(6)
    ]
    llm = LLM(path, max_model_len=512, max_num_seqs=4, enforce_eager=eager)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], llm


@pytest.mark.parametrize(
    "arch", ["qwen3", "llama", "qwen2-sliding", "gemma3", "mixtral"]
)
def test_graphs_sample_the_eager_tokens(arch, model_path):
    path = model_path(arch)
    eager, _ = generated(path, eager=True)
    tokens, llm = generated(path, eager=False)
    assert tokens == eager
    captured = llm.engine.runner.graphs.graphs
    assert captured and set(captured) <= {1, 2, 4}
    # a mixture's routing counts tokens per expert (`bincount`): eager at every size
    replayed = [graph is not None for graph in captured.values()]
    assert all(replayed) if arch != "mixtral" else not any(replayed)


def test_tensors_in_use_together_never_share_the_arenas_bytes(qwen3_path):
    _, llm = generated(qwen3_path, eager=False)
    for graph in llm.engine.runner.graphs.graphs.values():
        spans, offsets, sizes = graph.spans, graph.offsets, graph.sizes
        for a in spans:
            for b in spans:
                together = spans[a][0] <= spans[b][1] and spans[b][0] <= spans[a][1]
                apart = (
                    offsets[a] + sizes[a] <= offsets[b]
                    or offsets[b] + sizes[b] <= offsets[a]
                )
                assert a == b or not together or apart
        # two layers: what the first used, the second uses again
        assert graph.arena_bytes < 0.75 * sum(sizes.values())


def test_capturing_imports_no_compiler(qwen3_path):
    """Entering a dispatch mode makes torch import torch._dynamo (seconds) unless the
    mode says it needs none; the first decode step would wait for it."""
    script = f"""
import sys
from nanopaged import LLM, SamplingParams
llm = LLM({qwen3_path!r})
llm.generate([[5, 6, 7]] * 2, SamplingParams(max_tokens=4), use_tqdm=False)
assert all(llm.engine.runner.graphs.graphs.values())
print("torch._dynamo" in sys.modules)
"""
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    )
    assert run.stdout.split() == ["False"]
