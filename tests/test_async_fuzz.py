"""The async fuzz's configurations, kept as tests: seeded random engine options
(block size, pool size: preemption, token budget: chunks, scheduling, prefix caching,
eager or step graphs, backend) and requests (lengths, shared prefixes, n, greedy or
seeded sampling, stop tokens, lengths, logprobs). With async scheduling, every request's
tokens, finish reasons and logprobs are the synchronous engine's, and the greedy ones
are transformers'."""

import random

import pytest
import torch
from conftest import random_prompts
from test_reliability import assert_engine_is_clean

from nanopaged import LLM, SamplingParams
from nanopaged.async_scheduling import AsyncEngine

NUM_CONFIGURATIONS = 32


def configuration(seed: int) -> tuple[dict, list, list]:
    """(engine options, prompts, sampling params), drawn from `seed`."""
    draw = random.Random(seed)
    prompts = []
    for length in random_prompts([draw.randint(1, 60) for _ in range(6)], seed=seed):
        if prompts and draw.random() < 0.4:  # a prefix of an earlier prompt, or all
            earlier = draw.choice(prompts)
            length = earlier[: draw.randint(1, len(earlier))] + length[:8]
        prompts.append(length)
    params = []
    for i in range(len(prompts)):
        greedy = draw.random() < 0.5
        params.append(
            SamplingParams(
                temperature=0 if greedy else 0.8,
                seed=None if greedy else seed * 100 + i,
                n=draw.choice([1, 1, 2, 3]),
                max_tokens=draw.randint(1, 20),
                ignore_eos=draw.random() < 0.7,
                stop_token_ids=draw.sample(range(3, 512), 40)
                if draw.random() < 0.3
                else None,
                logprobs=draw.choice([None, None, 0, 3]),
            )
        )
    block_size = draw.choice([4, 16, 16])
    longest = max(len(p) + sp.max_tokens for p, sp in zip(prompts, params))
    options = dict(
        kvcache_block_size=block_size,
        # a pool that holds the longest request, and at times little more: preemption
        num_kvcache_blocks=-(-longest // block_size) + draw.choice([1, 4, 200]),
        max_num_batched_tokens=draw.choice([24, 64, 4096]),
        max_num_seqs=draw.choice([3, 64]),
        scheduling=draw.choice(["prefill-first", "mixed"]),
        enable_prefix_caching=draw.random() < 0.8,
        enforce_eager=draw.random() < 0.3,
        attention_backend=draw.choice(["cpu", "cpu", "torch"]),
    )
    return options, prompts, params


@pytest.mark.parametrize("seed", range(NUM_CONFIGURATIONS))
def test_async_scheduling_gives_the_synchronous_engines_outputs(
    seed, qwen3_path, hf_greedy
):
    options, prompts, params = configuration(seed)
    outputs = []
    for overlap in (False, True):
        llm = LLM(qwen3_path, max_model_len=256, async_scheduling=overlap, **options)
        outputs.append(llm.generate(prompts, params, use_tqdm=False))
    assert isinstance(llm.engine, AsyncEngine)
    assert_engine_is_clean(llm)
    sync, overlap = outputs
    for got, expected in zip(overlap, sync):
        for a, b in zip(got.outputs, expected.outputs):
            assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason)
            if b.logprobs is not None:
                assert [entry.keys() for entry in a.logprobs] == [
                    entry.keys() for entry in b.logprobs
                ]
                assert torch.allclose(
                    torch.tensor(
                        [e[t].logprob for e, t in zip(a.logprobs, a.token_ids)]
                    ),
                    torch.tensor(
                        [e[t].logprob for e, t in zip(b.logprobs, b.token_ids)]
                    ),
                    atol=1e-4,
                )
    plain = [
        i
        for i, sp in enumerate(params)
        if sp.temperature == 0 and sp.ignore_eos and not sp.stop_token_ids
    ]
    for i in plain:
        # transformers stops at the end-of-sequence token these ignore
        [expected] = hf_greedy(qwen3_path, [prompts[i]], params[i].max_tokens)
        assert all(c.token_ids[: len(expected)] == expected for c in overlap[i].outputs)
