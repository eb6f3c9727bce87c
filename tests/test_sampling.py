"""Sampling: seeds reproduce, top-k=1 is greedy, and the filters keep only what they
should."""

import pytest
import torch
from conftest import random_prompts

from nanopaged import LLM, SamplingParams
from nanopaged.core.sequence import Sequence
from nanopaged.sampling.vllm_sampler import VLLMSampler

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
    """`sampling/triton_kernel.py` is the GPU backends' sampler: seeded, through top-p,
    the tokens of the plain backend."""
    pytest.importorskip("triton")
    from nanopaged.sampling.triton_kernel import sample as kernel

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


def rows_that_are_no_distribution() -> torch.Tensor:
    """Rows of logits no softmax makes a distribution of, beside an ordinary one."""
    inf, nan = float("inf"), float("nan")
    logits = torch.randn(6, 5000, generator=torch.Generator().manual_seed(3))
    logits[0] = -inf  # every token masked (allowed_token_ids=[eos], min_tokens)
    logits[1, 4500] = logits[1, 4700] = inf  # two of infinite weight, past a block
    logits[2, 10] = nan
    logits[3, 20], logits[3, 4321] = inf, nan
    logits[4, :-1] = -inf  # one token left: an ordinary distribution
    return logits


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_a_row_that_is_no_distribution_samples_the_greedy_token_on_each_backend(
    backend,
):
    """Every sampler gives the same in-range id for such a row, its argmax (a NaN as
    +inf); the kernels' sample is the reference's."""
    from nanopaged.core.sampler import SAMPLING_KERNELS, first_argmax, sample

    if backend == "triton":
        pytest.importorskip("nanopaged.sampling.triton_kernel")
    logits = rows_that_are_no_distribution()
    temperatures, uniform = torch.full((6,), 0.7), torch.full((6,), 0.5)
    want = sample(logits, temperatures, uniform)
    assert want[:4].tolist() == [0, 4500, 10, 20]
    assert torch.equal(want[:4], first_argmax(logits[:4]))
    assert want[4] == 4999
    got = SAMPLING_KERNELS[backend](logits, temperatures, uniform)
    assert torch.equal(got, want)


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_a_request_whose_every_token_is_masked_gets_tokens_and_harms_nobody(
    qwen3_path, backend
):
    """allowed_token_ids=[eos] with min_tokens=3 leaves no token to sample: the request
    gets the greedy token of its masked row, in the vocabulary, and the other requests
    their tokens."""
    if backend == "triton":
        pytest.importorskip("nanopaged.sampling.triton_kernel")
    llm = LLM(qwen3_path, max_model_len=256, attention_backend=backend)
    eos = min(llm.inputs.eos_token_ids)
    masked = SamplingParams(allowed_token_ids=[eos], min_tokens=3, max_tokens=5)
    plain = SamplingParams(temperature=0, max_tokens=5)
    outputs = llm.generate(PROMPTS[:2], [masked, plain], use_tqdm=False)
    tokens = outputs[0].outputs[0].token_ids
    assert tokens == [0, 0, 0, eos]
    assert outputs[0].outputs[0].finish_reason == "stop"
    alone = llm.generate(PROMPTS[1:2], plain, use_tqdm=False)
    assert outputs[1].outputs[0].token_ids == alone[0].outputs[0].token_ids
