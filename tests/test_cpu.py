"""The CPU backend (nanopaged/cpu.py) against the plain-PyTorch reference: its attention, its
packed linear layers, and the process settings it makes."""
import math
import os

import pytest
import torch
import torch.nn.functional as F

from nanopaged import LLM, SamplingParams
from nanopaged import cpu
from nanopaged.core.attention import decode_torch, prefill_torch, store_kvcache_torch
from nanopaged.core import sampler
from nanopaged.core.layers import LinearMethod
from conftest import HEAD_DIM, metadata, paged_cache, random_prompts, relative_error

CONTEXT_LENS = [1, 17, 300, 64, 129, 130, 31]


@pytest.fixture
def small_groups(monkeypatch):
    """Groups of 16 KB of K and V (128 padded tokens of 1 KV head of 16 floats): the batches
    below span several groups."""
    monkeypatch.setattr(cpu, "GROUP_BYTES", 16384)


@pytest.mark.parametrize("block_size", [16, 8])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (4, 2), (8, 1)])
@pytest.mark.parametrize("window", [None, 5, 100])
def test_decode_matches_the_reference(block_size, num_heads, num_kv_heads, window, small_groups):
    k_cache, v_cache, tables = paged_cache(block_size, CONTEXT_LENS, num_kv_heads, seed=block_size)
    q = torch.randn(len(CONTEXT_LENS), num_heads, HEAD_DIM)
    meta = metadata(CONTEXT_LENS, tables)
    out = cpu.decode(q, k_cache, v_cache, meta, 0.25, window)
    assert relative_error(out, decode_torch(q, k_cache, v_cache, meta, 0.25, window)) < 1e-6
    order, groups = meta.plans[("cpu decode", window)]
    assert len(groups) > 1 or window == 5  # 5: two blocks a sequence


def test_decode_groups_sequences_of_similar_length_within_the_byte_budget(small_groups):
    """Shortest first; no group's padded K and V pass GROUP_BYTES, but a sequence longer alone."""
    lens = [900, 3, 40, 41, 700, 2]
    k_cache, _, tables = paged_cache(16, lens, 2, seed=1)
    order, groups = cpu.decode_plan(metadata(lens, tables), None, k_cache)
    assert order.tolist() == sorted(range(len(lens)), key=lambda i: lens[i])
    token_bytes = 2 * 2 * HEAD_DIM * 4
    start = 0
    for blocks, mask in groups:
        members = order[start:start + len(mask)].tolist()
        start += len(mask)
        assert len(blocks) == len(members) * mask.shape[-1] // 16
        assert len(blocks) * 16 * token_bytes <= cpu.GROUP_BYTES or len(members) == 1
        seen = (mask == 0).sum(dim=-1).flatten().tolist()
        assert seen == [lens[i] for i in members] and mask.max() == 0
    assert start == len(lens)


def test_a_batch_that_fits_one_group_is_the_plain_decode():
    k_cache, v_cache, tables = paged_cache(16, [5, 9], 2, seed=2)
    meta = metadata([5, 9], tables)
    q = torch.randn(2, 4, HEAD_DIM)
    assert torch.equal(cpu.decode(q, k_cache, v_cache, meta, 0.25),
                       decode_torch(q, k_cache, v_cache, meta, 0.25))
    assert meta.plans[("cpu decode", None)] is None


@pytest.mark.parametrize("window", [None, 3, 32])
def test_prefill_matches_the_reference_with_cached_prefixes(window):
    # (new query tokens, whole context): fresh prompts, prefix hits, a chunk, one token
    shapes = [(40, 40), (7, 39), (33, 290), (1, 18), (16, 16)]
    context_lens = [c for _, c in shapes]
    k_cache, v_cache, tables = paged_cache(16, context_lens, 2, seed=7)
    q_lens = [n for n, _ in shapes]
    cu = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    q = torch.randn(sum(q_lens), 4, HEAD_DIM)
    meta = metadata(context_lens, tables, cu_seqlens_q=cu, max_seqlen_q=max(q_lens))
    out = cpu.prefill(q, k_cache, v_cache, meta, 0.25, window)
    assert relative_error(out, prefill_torch(q, k_cache, v_cache, meta, 0.25, window)) < 1e-6


def test_store_writes_each_token_to_its_slot():
    k_cache, v_cache, _ = paged_cache(16, [64], 2, seed=3)
    k, v = torch.randn(2, 4, 2, HEAD_DIM).unbind(0)
    slots = torch.tensor([3, 70, 17, 0])
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    store_kvcache_torch(k, v, expected_k, expected_v, slots)
    cpu.store_kvcache(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch without oneDNN")
def test_a_packed_linear_multiplies_as_f_linear_and_frees_the_projections_weight():
    from nanopaged.core.layers import ParallelLMHead, RowParallelLinear, linear_methods
    with linear_methods(cpu.PackedLinear(), cpu.PackedLinear()):
        projection, head = RowParallelLinear(64, 48, bias=True), ParallelLMHead(500, 64)
    for layer in (projection, head):
        for param in layer.parameters():
            param.data.normal_()
    weights = [projection.weight.data.clone(), head.weight.data]
    for layer in (projection, head):
        layer.method.process_weights(layer)
    x = torch.randn(3, 7, 64)
    assert torch.allclose(projection(x), F.linear(x, weights[0], projection.bias), atol=1e-5)
    assert torch.allclose(head(x), F.linear(x, weights[1]), atol=1e-5)
    assert projection.weight is None and head.weight is not None  # the embedding's too


def test_half_weights_keep_f_linear():
    """oneDNN packs float32 and bfloat16; other dtypes multiply as before."""
    from nanopaged.core.layers import RowParallelLinear, linear_methods
    with linear_methods(cpu.PackedLinear(), cpu.PackedLinear()):
        layer = RowParallelLinear(8, 4).half()
    layer.method.process_weights(layer)
    assert type(layer.method) is LinearMethod and layer.weight is not None


@pytest.mark.parametrize("bf16", [True, False])
def test_bfloat16_weights_are_packed_only_where_the_cpu_has_its_instructions(bf16, monkeypatch):
    """oneDNN's bfloat16 path needs AVX-512 (or AVX-NE-CONVERT): without, it raises."""
    from nanopaged.core.layers import RowParallelLinear, linear_methods
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: bf16)
    cpu.packable_dtypes.cache_clear()
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", lambda w, _: w.clone())
    with linear_methods(cpu.PackedLinear(), cpu.PackedLinear()):
        layer = RowParallelLinear(8, 4).bfloat16()
    layer.method.process_weights(layer)
    assert (type(layer.method) is cpu.PackedLinear) == bf16
    cpu.packable_dtypes.cache_clear()


def test_auto_picks_the_cpu_backend_on_a_cpu_and_torch_stays_the_reference(qwen3_path):
    llm = LLM(qwen3_path)
    assert llm.config.attention_backend == "cpu" and llm.engine.runner.sampler.sample is cpu.sample
    runner = LLM(qwen3_path, attention_backend="torch").engine.runner
    assert runner.sampler.sample is sampler.sample
    assert all(type(m.method) is LinearMethod for m in runner.model.modules()
               if hasattr(m, "method"))


def cdf_bounds(logits, temperatures, tokens):
    """The cumulative probability before and after each row's token, in float64."""
    probs = torch.softmax(logits.double() / temperatures.double()[:, None], dim=-1)
    cdf = probs.cumsum(dim=-1)
    after = cdf.gather(1, tokens[:, None]).squeeze(1)
    return after - probs.gather(1, tokens[:, None]).squeeze(1), after


@pytest.mark.parametrize("vocab_size", [4096, 1000])  # 1000: no whole chunks, so one
def test_sample_inverts_the_cumulative_distribution_as_the_sampler_does(vocab_size):
    g = torch.Generator().manual_seed(vocab_size)
    logits = torch.randn(256, vocab_size, generator=g) * 4
    temperatures = torch.rand(256, generator=g) + 0.05
    uniform = torch.rand(256, generator=g)
    tokens = cpu.sample(logits, temperatures, uniform)
    before, after = cdf_bounds(logits, temperatures, tokens)
    # the token's interval of the distribution holds the uniform number, up to float32 rounding
    assert ((before <= uniform + 1e-5) & (uniform <= after + 1e-5)).all()
    agree = tokens == sampler.sample(logits, temperatures, uniform)
    assert agree.float().mean() > 0.99


def test_sample_never_picks_a_token_of_probability_zero():
    """Targets at and next to every chunk's boundary, and uniform numbers next to 1, over rows
    whose allowed tokens sit at the ends of chunks."""
    allowed = [0, 127, 128, 255, 300, 383, 511]
    logits = torch.full((1, 512), float("-inf"))
    logits[0, allowed] = torch.randn(len(allowed))
    probs = torch.softmax(logits, dim=-1)
    cuts = probs.cumsum(dim=-1)[0, allowed].tolist()
    targets = [0.0, 1 - 2 ** -24] + [math.nextafter(c, d) for c in cuts for d in (0, 1)] + cuts
    uniform = torch.tensor([t for t in targets if t < 1])
    rows = len(uniform)
    tokens = cpu.sample(logits.expand(rows, -1), torch.ones(rows), uniform)
    assert set(tokens.tolist()) <= set(allowed)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_greedy_matches_transformers_with_chunks_preemption_and_prefix_hits(arch, model_path,
                                                                           hf_greedy):
    from test_models import mixed_run
    mixed_run(model_path(arch), hf_greedy, attention_backend="cpu")


def test_seeded_samples_equal_the_reference_backends(qwen3_path):
    prompts = random_prompts([5, 40, 300], seed=4)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=12)
    tokens = [[o.outputs[0].token_ids for o in LLM(qwen3_path, attention_backend=backend)
               .generate(prompts, params, use_tqdm=False)] for backend in ("cpu", "torch")]
    assert tokens[0] == tokens[1]


def test_usable_cores_are_the_affinity_capped_by_the_cgroup_quota(monkeypatch, tmp_path):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5})
    quota = tmp_path / "cpu.max"
    real_open = open

    def fake_open(path, *args, **kwargs):
        if path == "/sys/fs/cgroup/cpu.max":
            return real_open(quota, *args, **kwargs)
        if str(path).startswith("/sys/fs/cgroup"):
            raise OSError(path)
        return real_open(path, *args, **kwargs)
    monkeypatch.setattr("builtins.open", fake_open)
    for limit, cores in (("max 100000", 6), ("250000 100000", 3), ("50000 100000", 1),
                         ("900000 100000", 6)):
        quota.write_text(limit)
        assert cpu.usable_cores() == cores


def test_threads_are_lowered_to_the_usable_cores_never_raised(monkeypatch):
    threads = [8]
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads[0])
    monkeypatch.setattr(torch, "set_num_threads", lambda n: threads.__setitem__(0, n))
    for usable, before, after in ((2, 8, 2), (16, 8, 8)):
        threads[0] = before
        monkeypatch.setattr(cpu, "usable_cores", lambda: usable)
        cpu.tune_process.__wrapped__()
        assert threads[0] == after
