"""What a request may ask of the logits (penalties, min_p, logit_bias,
allowed_token_ids, bad_words) and prompt logprobs, each against transformers or a plain
reference."""

import pytest
import torch
from conftest import random_prompts
from transformers import MinPLogitsWarper

from nanopaged import LLM, SamplingParams
from nanopaged.core.sequence import Sequence
from nanopaged.sampling.vllm_sampler import VLLMSampler

PROMPTS = random_prompts([6, 17, 30], seed=70)
STEPS = 16


@pytest.fixture(scope="module")
def llm(qwen3_path):
    return LLM(qwen3_path, max_model_len=256, kvcache_block_size=16)


def hf_generate(hf_model, path, prompt, **options) -> list[int]:
    with torch.no_grad():
        out = hf_model(path).generate(
            torch.tensor([prompt]),
            max_new_tokens=STEPS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            **options,
        )
    return out[0, len(prompt) :].tolist()


def reference_greedy(hf_model, path, prompt, adjust) -> list[int]:
    """Greedy decoding, one full forward a token, with `adjust(logits, completion)`
    applied to the next token's logits: a plain reference for vLLM's semantics."""
    completion = []
    for _ in range(STEPS):
        with torch.no_grad():
            logits = (
                hf_model(path)(torch.tensor([prompt + completion]))
                .logits[0, -1]
                .float()
            )
        completion.append(int(adjust(logits, completion).argmax()))
    return completion


def generate(llm, prompt, **params) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, **params)
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_is_transformers(llm, qwen3_path, hf_model, penalty):
    for prompt in PROMPTS:
        assert generate(llm, prompt, repetition_penalty=penalty) == hf_generate(
            hf_model, qwen3_path, prompt, repetition_penalty=penalty
        )


@pytest.mark.parametrize(
    "frequency, presence, repeats",  # repeats: completions that tell the two apart
    [
        (0.9, 0.0, False),
        (0.0, 1.5, False),
        (-0.8, 0.6, False),
        (-0.5, 1.0, True),
        (-1.5, 2.0, True),
    ],
)
def test_frequency_and_presence_penalties_count_the_completion(
    llm, qwen3_path, hf_model, frequency, presence, repeats
):
    """A frequency penalty per occurrence, a presence penalty once per token that
    occurred: completions whose tokens repeat tell the two apart (a presence penalty
    counted per occurrence gives other tokens)."""

    def adjust(logits, completion, per_occurrence=False):
        counts = torch.bincount(
            torch.tensor(completion, dtype=torch.int64), minlength=logits.shape[0]
        ).float()
        present = counts if per_occurrence else (counts > 0).float()
        return logits - frequency * counts - presence * present

    completions = []
    for prompt in PROMPTS:
        tokens = generate(
            llm, prompt, frequency_penalty=frequency, presence_penalty=presence
        )
        assert tokens == reference_greedy(hf_model, qwen3_path, prompt, adjust)
        completions.append(tokens)
    if repeats:  # a presence penalty counted per occurrence would give other tokens
        assert any(len(set(tokens)) < len(tokens) for tokens in completions)
        wrong = [
            reference_greedy(
                hf_model,
                qwen3_path,
                p,
                lambda lg, c: adjust(lg, c, per_occurrence=True),
            )
            for p in PROMPTS
        ]
        assert wrong != completions


def test_logit_bias_is_transformers_sequence_bias(llm, qwen3_path, hf_model):
    bias = {101: 4.0, 202: -50.0, 303: 2.5}
    for prompt in PROMPTS:
        assert generate(llm, prompt, logit_bias=bias) == hf_generate(
            hf_model,
            qwen3_path,
            prompt,
            sequence_bias={(t,): b for t, b in bias.items()},
        )
    # clamped to 100
    assert set(generate(llm, PROMPTS[0], logit_bias={77: 200.0})) == {77}


def test_allowed_token_ids_are_the_only_tokens(llm, qwen3_path, hf_model):
    allowed = [5, 50, 150, 250, 350, 450]
    for prompt in PROMPTS:
        tokens = generate(llm, prompt, allowed_token_ids=allowed)
        assert set(tokens) <= set(allowed) and tokens == hf_generate(
            hf_model,
            qwen3_path,
            prompt,
            prefix_allowed_tokens_fn=lambda batch, ids: allowed,
        )


def test_bad_words_are_never_completed(llm, qwen3_path, hf_model):
    plain = generate(llm, PROMPTS[1])
    # ban the pair the model generates first, and a single token it generates later
    pair = llm.tokenizer.decode(plain[:2])
    words = [pair, llm.tokenizer.decode(plain[5:6])]
    banned = [
        llm.tokenizer.encode(v, add_special_tokens=False)
        for w in words
        for v in (w.lstrip(), " " + w.lstrip())
    ]

    def adjust(logits, completion):
        logits = logits.clone()
        for word in banned:
            if (
                completion[len(completion) - len(word) + 1 :] == word[:-1]
                or len(word) == 1
            ):
                logits[word[-1]] = float("-inf")
        return logits

    tokens = generate(llm, PROMPTS[1], bad_words=words)
    assert tokens != plain and tokens == reference_greedy(
        hf_model, qwen3_path, PROMPTS[1], adjust
    )


def test_each_row_of_a_batch_gets_its_own_adjustments(llm):
    """One batch mixing plain rows with each kind of adjustment: every row as it is
    alone."""
    kinds = [
        dict(),
        dict(repetition_penalty=1.4),
        dict(logit_bias={9: 3.0}),
        dict(frequency_penalty=0.5),
        dict(allowed_token_ids=[3, 4, 5, 6]),
        dict(),
    ]
    prompts = random_prompts([5, 9, 14, 7, 11, 20], seed=71)
    alone = [generate(llm, p, **k) for p, k in zip(prompts, kinds)]
    params = [
        SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, **k)
        for k in kinds
    ]
    together = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in together] == alone


def test_min_p_keeps_the_tokens_at_least_min_p_times_as_likely_as_the_best():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    sampler = VLLMSampler(torch.device("cpu"))
    seqs = [
        Sequence([1], SamplingParams(min_p=0.2, temperature=1.0)) for _ in range(400)
    ]
    sampled = set(sampler(logits.expand(400, -1).clone(), seqs).tolist())
    kept = MinPLogitsWarper(min_p=0.2)(None, logits.clone()).isfinite()[0].nonzero()
    assert sampled == {0, 1, 2} == set(kept.flatten().tolist())


# ---- prompt logprobs ----


def hf_prompt_logprobs(hf_model, path, prompt, k):
    with torch.no_grad():
        logits = hf_model(path)(torch.tensor([prompt])).logits[0].float()
    reference = logits.log_softmax(dim=-1)
    entries = [None]
    for position in range(1, len(prompt)):
        row, token = reference[position - 1], prompt[position]
        top = row.topk(k)
        entries.append(
            {
                token: row[token].item(),
                **dict(zip(top.indices.tolist(), top.values.tolist())),
            }
        )
    return entries


def assert_prompt_logprobs(output, expected):
    assert len(output.prompt_logprobs) == len(expected) == len(output.prompt_token_ids)
    assert output.prompt_logprobs[0] is None
    for got, want in zip(output.prompt_logprobs[1:], expected[1:]):
        assert list(got) == list(want)
        assert all(abs(got[t].logprob - lp) < 1e-4 for t, lp in want.items())


@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(max_num_batched_tokens=8),
        dict(num_kvcache_blocks=5, max_num_batched_tokens=64),
    ],
)
def test_prompt_logprobs_are_transformers_log_softmax(qwen3_path, hf_model, options):
    """Whole, in chunks, and under preemption (each prompt token reported once)."""
    llm = LLM(qwen3_path, max_model_len=256, kvcache_block_size=16, **options)
    prompts = random_prompts([20, 33, 9], seed=72)
    params = SamplingParams(
        temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=3
    )
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        assert_prompt_logprobs(
            output, hf_prompt_logprobs(hf_model, qwen3_path, prompt, 3)
        )
    plain = llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None


def test_prompt_logprobs_are_computed_even_when_the_prefix_is_cached(
    llm, qwen3_path, hf_model
):
    prompt = random_prompts([40], seed=73)[0]
    # caches 32 tokens
    llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)
    [output] = llm.generate(
        [prompt], SamplingParams(max_tokens=2, prompt_logprobs=1), use_tqdm=False
    )
    assert output.num_cached_tokens == 0
    assert_prompt_logprobs(output, hf_prompt_logprobs(hf_model, qwen3_path, prompt, 1))
