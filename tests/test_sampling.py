"""Sampling: seeds reproduce, top-k=1 is greedy, and the filters keep only what they
should."""

import pytest
import torch
from conftest import random_prompts

from nanopaged import LLM, SamplingParams
from nanopaged.core.sequence import Sequence
from nanopaged.sampling import VLLMSampler

PROMPTS = random_prompts([5, 30, 12], seed=11)


def test_seeded_sampling_is_reproducible_whatever_shares_the_batch(qwen3_path):
    llm = LLM(qwen3_path, max_model_len=256)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=20, seed=123)
    alone = llm.generate(PROMPTS[:1], seeded, use_tqdm=False)[0].outputs[0].token_ids
    other = SamplingParams(temperature=0.8, max_tokens=20)
    batched = (
        llm.generate(PROMPTS, [seeded, other, other], use_tqdm=False)[0]
        .outputs[0]
        .token_ids
    )
    assert alone == batched


def test_different_seeds_give_different_samples(qwen3_path):
    llm = LLM(qwen3_path, max_model_len=256)
    outs = llm.generate(
        PROMPTS[:1] * 2,
        [SamplingParams(max_tokens=20, seed=s) for s in (1, 2)],
        use_tqdm=False,
    )
    assert outs[0].outputs[0].token_ids != outs[1].outputs[0].token_ids


def test_top_k_1_equals_greedy(qwen3_path):
    llm = LLM(qwen3_path, max_model_len=256)
    greedy = llm.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False
    )
    top1 = llm.generate(
        PROMPTS, SamplingParams(temperature=1.5, top_k=1, max_tokens=20), use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in greedy] == [
        o.outputs[0].token_ids for o in top1
    ]


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("temperature", [1e-38, 1e-40, 1e-6])
def test_a_tiny_temperature_samples_the_argmax(qwen3_path, backend, temperature):
    """Whatever temperature SamplingParams accepts gives the same tokens on every
    backend: below 1e-5 (vLLM's bound) greedy ones, even where 1 / T would overflow
    float32 (under ~3e-39)."""
    llm = LLM(qwen3_path, max_model_len=256, attention_backend=backend)
    greedy = llm.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False
    )
    for params in (
        SamplingParams(temperature=temperature, max_tokens=20, seed=1),
        SamplingParams(temperature=temperature, top_p=0.9, max_tokens=20, seed=1),
    ):
        tiny = llm.generate(PROMPTS, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in tiny] == [
            o.outputs[0].token_ids for o in greedy
        ]


def _sample_many(
    logits: torch.Tensor, params: SamplingParams, n: int = 400
) -> set[int]:
    sampler = VLLMSampler(torch.device("cpu"))
    seqs = [Sequence([1], params) for _ in range(n)]
    return set(sampler(logits.expand(n, -1).clone(), seqs).tolist())


def test_top_k_keeps_only_the_k_most_likely():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0, -1.0]])
    assert _sample_many(logits, SamplingParams(top_k=2)) == {1, 3}


def test_top_p_keeps_the_smallest_set_reaching_p():
    # probabilities 0.5, 0.3, 0.2: top_p=0.7 keeps the first two
    logits = torch.tensor([[0.5, 0.3, 0.2]]).log()
    assert _sample_many(logits, SamplingParams(top_p=0.7)) == {0, 1}


def test_the_first_of_n_seeded_samples_is_the_single_sample(qwen3_path):
    llm = LLM(qwen3_path, max_model_len=256)
    params = dict(temperature=1.0, max_tokens=12, seed=77, ignore_eos=True)
    [single] = llm.generate(PROMPTS[:1], SamplingParams(**params), use_tqdm=False)
    [several] = llm.generate(PROMPTS[:1], SamplingParams(n=3, **params), use_tqdm=False)
    samples = [c.token_ids for c in several.outputs]
    assert (
        samples[0] == single.outputs[0].token_ids and len(set(map(tuple, samples))) == 3
    )


def test_the_triton_backend_samples_by_its_kernel_the_tokens_of_torch(qwen3_path):
    """`triton_sample` is the GPU backends' sampler: seeded, through top-p, the tokens
    of the plain backend."""
    pytest.importorskip("triton")
    from nanopaged.triton_sample import sample as kernel

    params = [
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, seed=seed)
        for seed in (1, 2, 3)
    ]
    tokens = {}
    for backend in ("torch", "triton"):
        llm = LLM(qwen3_path, max_model_len=256, attention_backend=backend)
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        tokens[backend] = [o.outputs[0].token_ids for o in outputs]
    assert llm.engine.runner.sampler.sample is kernel
    assert tokens["triton"] == tokens["torch"]
