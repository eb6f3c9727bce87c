"""Speculative decoding: proposals verified in one step give exactly the tokens of
decoding one at a time (and transformers'), greedy or seeded; sampled rows keep the
model's distribution; and the pool and the prefix cache stay whole around rejected
proposals."""

from collections import Counter

import pytest
import torch
from conftest import ScriptedRunner, random_prompts
from test_scheduler import add

from nanopaged import LLM, SamplingParams
from nanopaged.core.block_manager import BlockManager
from nanopaged.core.sequence import Sequence
from nanopaged.speculative import SpeculativeEngine, ngram_proposals

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
}


def draft_config(path: str, k: int = 4) -> dict:
    return {"model": path, "num_speculative_tokens": k}


def prompts() -> list[list[int]]:
    """Random prompts (two longer than a block), and a repetitive one n-grams can
    continue."""
    return random_prompts([5, 17, 40, 3]) + [[5, 6, 7, 8] * 6]


def as_inputs(token_lists: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": tokens} for tokens in token_lists]


def completions(
    llm: LLM, token_lists: list[list[int]], params: SamplingParams
) -> list[list[int]]:
    return [
        o.outputs[0].token_ids
        for o in llm.generate(as_inputs(token_lists), params, use_tqdm=False)
    ]


def assert_pool_whole(llm: LLM) -> None:
    pool = llm.engine.block_manager
    assert pool.num_free_blocks == pool.num_blocks and not pool.uncommitted
    assert not any(pool.ref_counts)


GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


# ---- proposals ----


def test_ngram_proposes_what_followed_the_latest_occurrence_of_the_longest_suffix():
    tokens = [1, 2, 3, 9, 7, 2, 3, 4, 5, 2, 3]
    assert ngram_proposals(tokens, 2, 1, 3) == [4, 5]  # [2, 3] last seen before 4, 5
    # the repetition goes on
    assert ngram_proposals(tokens, 6, 1, 3) == [4, 5, 2, 3, 4, 5]
    assert ngram_proposals([1, 6, 6, 6], 3, 2, 2) == [6, 6, 6]
    # [2] alone: latest
    assert ngram_proposals([8, 1, 2, 9, 1, 2, 5, 2], 2, 1, 3) == [5, 2]
    # the longest suffix wins over a later, shorter match
    assert ngram_proposals([7, 1, 2, 4, 3, 2, 6, 1, 2], 1, 1, 3) == [4]
    assert ngram_proposals([1, 2, 3, 4, 2], 3, 2, 3) == []  # no 2-gram occurred before
    assert ngram_proposals([4], 3, 1, 3) == []


@pytest.mark.parametrize(
    "options, message",
    [
        ({"num_speculative_tokens": 0}, "num_speculative_tokens must be >= 1"),
        ({"num_speculative_tokens": 2, "method": "eagle"}, "method must be"),
        ({"num_speculative_tokens": 2, "method": "draft_model"}, "named with 'model'"),
        ({"num_speculative_tokens": 2, "lookahead": 3}, "got lookahead"),
        (
            {
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 4,
                "prompt_lookup_max": 2,
            },
            "prompt_lookup_min <= prompt_lookup_max",
        ),
        (
            {"num_speculative_tokens": "4"},
            "num_speculative_tokens must be int, got '4'",
        ),
        (
            {"num_speculative_tokens": 2.0},
            "num_speculative_tokens must be int, got 2.0",
        ),
        (
            {"num_speculative_tokens": 2, "prompt_lookup_max": 3.5},
            "prompt_lookup_max must be int",
        ),
        (
            {"num_speculative_tokens": 2, "prompt_lookup_min": 0},
            "prompt_lookup_min must be >= 1",
        ),
        (
            {"num_speculative_tokens": 2, "disable_by_batch_size": "8"},
            "disable_by_batch_size must",
        ),
        ({"num_speculative_tokens": 2, "model": 5}, "model must be str or None"),
        ([3], "speculative_config must be"),
    ],
)
def test_bad_speculative_config_is_a_value_error_naming_it(
    qwen3_path, options, message
):
    with pytest.raises(ValueError, match=message):
        LLM(qwen3_path, speculative_config=options)


def test_prompt_lookup_bounds_are_honoured_as_written(qwen3_path):
    llm = LLM(
        qwen3_path,
        speculative_config={"num_speculative_tokens": 2, "prompt_lookup_min": 2},
    )
    proposer = llm.engine.proposer
    assert (proposer.shortest, proposer.longest) == (2, 2)  # vLLM: max = min
    llm = LLM(
        qwen3_path,
        speculative_config={"num_speculative_tokens": 2, "prompt_lookup_max": 3},
    )
    assert (llm.engine.proposer.shortest, llm.engine.proposer.longest) == (3, 3)


def test_a_bad_speculative_config_on_the_command_line_is_one_line(qwen3_path):
    import subprocess
    import sys

    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "nanopaged",
            "serve",
            qwen3_path,
            "--speculative-config",
            '{"num_speculative_tokens": "4"}',
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        "nanopaged serve: error: num_speculative_tokens must be int, got '4'"
    ]


def test_draft_model_needs_the_models_vocabulary(qwen3_path, checkpoint_root):
    from nanopaged.random_checkpoint import TINY_QWEN3, write_random_checkpoint

    other = write_random_checkpoint(
        f"{checkpoint_root}/vocab300", dict(TINY_QWEN3, vocab_size=300)
    )
    with pytest.raises(ValueError, match="same tokenizer"):
        LLM(qwen3_path, speculative_config=draft_config(other))


# ---- greedy: token-exact ----


# the draft runs the same kernels as the model: once is enough
@pytest.mark.parametrize(
    "method, backend",
    [
        ("ngram", "torch"),
        ("draft", "torch"),
        ("ngram", "cpu"),
        ("draft", "cpu"),
        ("ngram", "triton"),
    ],
)
def test_greedy_speculation_gives_transformers_tokens(
    qwen3_path, hf_greedy, backend, method
):
    spec = NGRAM if method == "ngram" else draft_config(qwen3_path)
    llm = LLM(
        qwen3_path,
        attention_backend=backend,
        num_kvcache_blocks=64,
        speculative_config=spec,
    )
    assert completions(llm, prompts(), GREEDY) == hf_greedy(qwen3_path, prompts(), 40)
    stats = llm.stats()
    assert stats.num_accepted_tokens > 20
    # the draft is the model itself: it proposes the model's tokens
    if method == "draft":
        assert stats.num_accepted_tokens == stats.num_proposed_tokens
    assert_pool_whole(llm)


def test_steps_with_lookahead_slots_but_no_proposals_decode_right(
    qwen3_path, hf_greedy
):
    """Random prompts rarely repeat a 3-gram: most steps reserve slots and propose
    nothing."""
    spec = dict(NGRAM, prompt_lookup_min=3)
    llm = LLM(qwen3_path, num_kvcache_blocks=64, speculative_config=spec)
    assert completions(llm, prompts()[:4], GREEDY) == hf_greedy(
        qwen3_path, prompts()[:4], 40
    )
    assert_pool_whole(llm)


@pytest.mark.parametrize(
    "options",
    [
        dict(num_kvcache_blocks=12),  # preemptions
        # prompts prefilled in chunks
        dict(max_num_batched_tokens=16, num_kvcache_blocks=64),
        dict(scheduling="mixed", max_num_batched_tokens=24, num_kvcache_blocks=64),
    ],
    ids=["preemption", "chunked-prefill", "mixed"],
)
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_speculation_is_exact_under_pressure(
    qwen3_path, hf_greedy, options, method
):
    spec = NGRAM if method == "ngram" else draft_config(qwen3_path)
    llm = LLM(qwen3_path, speculative_config=spec, **options)
    assert completions(llm, prompts(), GREEDY) == hf_greedy(qwen3_path, prompts(), 40)
    if "num_kvcache_blocks" in options and options["num_kvcache_blocks"] < 20:
        assert llm.stats().num_preemptions > 0
    assert llm.stats().num_accepted_tokens > 0
    assert_pool_whole(llm)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_prefix_hits_and_forks_with_speculation(qwen3_path, hf_greedy, method):
    spec = NGRAM if method == "ngram" else draft_config(qwen3_path)
    llm = LLM(qwen3_path, num_kvcache_blocks=64, speculative_config=spec)
    want = hf_greedy(qwen3_path, prompts(), 40)
    assert completions(llm, prompts(), GREEDY) == want
    # again: the prompts' blocks, and the blocks of accepted tokens, are hits now
    again = [prompt + completion[:20] for prompt, completion in zip(prompts(), want)]
    outputs = llm.generate(as_inputs(again), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(qwen3_path, again, 40)
    assert sum(o.num_cached_tokens for o in outputs) >= 16 * 4
    forked = llm.generate(
        as_inputs(prompts()),
        SamplingParams(n=3, temperature=0, max_tokens=40, ignore_eos=True),
        use_tqdm=False,
    )
    assert [[c.token_ids for c in o.outputs] for o in forked] == [[w] * 3 for w in want]
    assert_pool_whole(llm)


def test_stops_inside_an_accepted_run_cut_it_there(qwen3_path, hf_greedy, model_path):
    """A stop token, a stop string or max_tokens in the middle of accepted tokens ends
    the completion exactly where decoding one token at a time ends it."""
    llm = LLM(
        qwen3_path, num_kvcache_blocks=64, speculative_config=draft_config(qwen3_path)
    )
    plain = LLM(qwen3_path, num_kvcache_blocks=64)
    prompt = prompts()[4]
    want = hf_greedy(qwen3_path, [prompt], 40)[0]
    cases = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        for n in (1, 2, 7, 13)
    ]
    cases.append(
        SamplingParams(
            temperature=0, max_tokens=40, stop_token_ids=[want[9]], ignore_eos=True
        )
    )
    stop = (
        plain.generate(as_inputs([prompt]), GREEDY, use_tqdm=False)[0]
        .outputs[0]
        .text[6:9]
    )
    cases.append(
        SamplingParams(temperature=0, max_tokens=40, stop=[stop], ignore_eos=True)
    )
    cases.append(
        SamplingParams(
            temperature=0,
            max_tokens=40,
            stop=[stop],
            ignore_eos=True,
            include_stop_str_in_output=True,
            logprobs=2,
        )
    )
    for params in cases:
        got = llm.generate(as_inputs([prompt]), params, use_tqdm=False)[0].outputs[0]
        expected = plain.generate(as_inputs([prompt]), params, use_tqdm=False)[
            0
        ].outputs[0]
        assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == (
            expected.token_ids,
            expected.text,
            expected.finish_reason,
            expected.stop_reason,
        )
        if params.logprobs:
            assert len(got.logprobs) == len(got.token_ids)
            for a, b in zip(got.logprobs, expected.logprobs):
                assert a.keys() == b.keys()
                assert all(
                    a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4) for t in a
                )
    assert llm.stats().num_accepted_tokens > 0
    assert_pool_whole(llm)


def test_a_row_that_adjusts_its_logits_decodes_one_token_at_a_time(qwen3_path):
    llm = LLM(
        qwen3_path, num_kvcache_blocks=64, speculative_config=draft_config(qwen3_path)
    )
    plain = LLM(qwen3_path, num_kvcache_blocks=64)
    params = [
        SamplingParams(
            temperature=0, max_tokens=30, ignore_eos=True, repetition_penalty=1.5
        ),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, min_tokens=30),
    ]
    batch = as_inputs(prompts()[:2])
    got = llm.generate(batch, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [
        o.outputs[0].token_ids for o in plain.generate(batch, params, use_tqdm=False)
    ]
    assert llm.stats().num_proposed_tokens == 0


# ---- which sequences get lookahead slots ----


class EverySlot:
    """A proposer that fills every slot it is given (with token 5)."""

    def propose(self, step, slots, runner):
        return {i: [5] * k for i, k in slots.items()}


@pytest.fixture
def scripted(qwen3_path):
    """scripted(**options) -> an LLM speculating 3 tokens ahead, with 4-token blocks,
    whose steps run a ScriptedRunner (which accepts no proposal) and propose in every
    slot."""

    def make(num_blocks=64, disable_by_batch_size=None, **options) -> LLM:
        spec = dict(NGRAM, disable_by_batch_size=disable_by_batch_size)
        llm = LLM(
            qwen3_path,
            kvcache_block_size=4,
            num_kvcache_blocks=num_blocks,
            speculative_config=spec,
            **options,
        )
        llm.engine.runner = ScriptedRunner()
        llm.engine.proposer = EverySlot()
        return llm

    return make


def lookahead_of_each_step(llm: LLM, seq: Sequence) -> list[int]:
    steps = llm.engine.runner.steps
    return [
        len(step.proposals.get(step.seqs.index(seq), ()))
        for step in steps
        if seq in step.seqs
    ]


def test_lookahead_stops_at_max_tokens_and_max_model_len(scripted):
    llm = scripted(max_model_len=12)
    short = add(llm, [1, 2, 3], max_tokens=4)
    long = add(llm, [1, 2, 3, 4, 5, 6], max_tokens=20)
    while not llm.is_finished():
        llm.step()
    # the prefill step samples token 1; then room for 3 tokens: a token and 2 proposals,
    # ...
    assert lookahead_of_each_step(llm, short) == [0, 2, 1, 0]
    assert lookahead_of_each_step(llm, long) == [0, 3, 3, 2, 1, 0]  # max_model_len 12
    assert len(short.completion_token_ids) == 4 and len(long) == 12
    assert_pool_whole(llm)


def test_no_lookahead_above_disable_by_batch_size(scripted):
    llm = scripted(disable_by_batch_size=2)
    seqs = [add(llm, [1, 2, 3], max_tokens=n) for n in (3, 4, 8)]
    while not llm.is_finished():
        llm.step()
    # three run until the first finishes in step 3
    assert lookahead_of_each_step(llm, seqs[2]) == [0, 0, 0, 3, 3, 2, 1, 0]
    assert_pool_whole(llm)


def test_no_lookahead_for_sequences_with_logits_processors(scripted):
    """Penalties, min_tokens, grammars: their logits depend on each token the sequence
    gets."""
    llm = scripted()
    seqs = [
        add(llm, [1, 2, 3], max_tokens=6, presence_penalty=0.5),
        add(llm, [1, 2, 3], max_tokens=6, min_tokens=3),
        add(llm, [1, 2, 3], max_tokens=6),
    ]
    while not llm.is_finished():
        llm.step()
    assert lookahead_of_each_step(llm, seqs[0]) == [0] * 6
    assert lookahead_of_each_step(llm, seqs[1]) == [0] * 6
    assert lookahead_of_each_step(llm, seqs[2]) == [0, 3, 3, 2, 1, 0]


def test_proposals_never_preempt_they_shrink_to_the_free_slots(scripted):
    llm = scripted(num_blocks=3)
    seqs = [add(llm, [1, 2], max_tokens=6), add(llm, list(range(1, 8)), max_tokens=2)]
    llm.step()  # both prefilled, in three blocks: the pool is empty
    assert llm.engine.block_manager.num_free_blocks == 0
    llm.step()
    # the first has room for 3 proposals but a free slot for 1 in its block; the
    # second's token fills its last block
    assert lookahead_of_each_step(llm, seqs[0]) == [0, 1]
    assert llm.engine.scheduler.num_preemptions == 0
    while not llm.is_finished():
        llm.step()
    assert llm.engine.scheduler.num_preemptions == 0
    assert_pool_whole(llm)


# ---- sampling: the model's distribution ----


def chi_square_p_value_of(statistic: torch.Tensor, dof: int) -> float:
    return torch.special.gammaincc(
        torch.tensor(dof / 2, dtype=torch.float64), statistic.double() / 2
    ).item()


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_seeded_sampled_speculation_gives_the_tokens_of_no_speculation(
    qwen3_path, method
):
    """A seeded row samples each position with the number its seed gives that position,
    and keeps a proposal only when it is that sample: the same tokens as without
    speculation."""
    spec = NGRAM if method == "ngram" else draft_config(qwen3_path)
    llm = LLM(qwen3_path, num_kvcache_blocks=64, speculative_config=spec)
    plain = LLM(qwen3_path, num_kvcache_blocks=64)
    params = [
        SamplingParams(temperature=t, top_p=p, max_tokens=40, seed=s, ignore_eos=True)
        for t, p, s in (
            (0.3, 1.0, 1),
            (0.8, 0.9, 2),
            (1.0, 1.0, 3),
            (0.5, 0.7, 4),
            (0.2, 1.0, 5),
        )
    ]
    assert completions(llm, prompts(), params) == completions(plain, prompts(), params)
    assert llm.stats().num_accepted_tokens > 20
    assert_pool_whole(llm)


def homogeneity_p_value(a: Counter, b: Counter) -> float:
    """Chi-square test that two samples come from one distribution (tokens seen fewer
    than 10 times in both pooled into one category)."""
    common = [t for t in set(a) | set(b) if a[t] + b[t] >= 10]
    table = torch.tensor(
        [
            [c[t] for t in common] + [c.total() - sum(c[t] for t in common)]
            for c in (a, b)
        ],
        dtype=torch.float64,
    )
    table = table[:, table.sum(0) > 0]
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    return chi_square_p_value_of(
        ((table - expected) ** 2 / expected).sum(), table.shape[1] - 1
    )


def test_sampled_speculation_keeps_the_models_distribution(qwen3_path):
    """2,000 samples of 3 tokens with and without a draft model: the second token (the
    one a proposal verified) and the third follow the same distribution."""
    samples = []
    for spec in (None, draft_config(qwen3_path, 3)):
        llm = LLM(qwen3_path, speculative_config=spec)
        params = [
            SamplingParams(
                n=500, temperature=0.2, max_tokens=3, ignore_eos=True, seed=s
            )
            for s in range(4)
        ]
        outputs = llm.generate(as_inputs(prompts()[4:] * 4), params, use_tqdm=False)
        samples.append([c.token_ids for o in outputs for c in o.outputs])
    assert llm.stats().num_accepted_tokens > 500
    for position in (1, 2):
        counts = [Counter(tokens[position] for tokens in s) for s in samples]
        assert homogeneity_p_value(*counts) > 1e-3


def test_top_k_1_sampling_with_speculation_is_greedy(qwen3_path, hf_greedy):
    llm = LLM(
        qwen3_path, num_kvcache_blocks=64, speculative_config=draft_config(qwen3_path)
    )
    params = SamplingParams(temperature=1.0, top_k=1, max_tokens=40, ignore_eos=True)
    assert completions(llm, prompts(), params) == hf_greedy(qwen3_path, prompts(), 40)
    assert llm.stats().num_accepted_tokens == llm.stats().num_proposed_tokens > 0


def test_a_seeded_request_is_the_same_alone_and_in_a_batch_that_leaves_it_fewer_slots(
    qwen3_path,
):
    """Alone, the seeded request gets 4 lookahead slots a step; beside six others in a
    budget of 8 tokens, one at most: how many tokens a step verifies does not change its
    tokens."""
    params = SamplingParams(temperature=0.3, max_tokens=30, seed=11, ignore_eos=True)
    others = random_prompts([6, 7, 8, 9, 10, 11], seed=5)
    spec = dict(NGRAM, num_speculative_tokens=4)
    alone = LLM(
        qwen3_path,
        num_kvcache_blocks=64,
        max_num_batched_tokens=64,
        speculative_config=spec,
    )
    shared = LLM(
        qwen3_path,
        num_kvcache_blocks=64,
        max_num_batched_tokens=8,
        speculative_config=spec,
    )
    [want] = completions(alone, prompts()[4:], params)
    got = completions(shared, others + prompts()[4:], [GREEDY] * 6 + [params])
    assert got[6] == want
    assert alone.stats().num_accepted_tokens > 5  # proposals were verified, and kept


def test_sampled_speculation_is_reproducible_and_ignores_the_batch(qwen3_path):
    llm = LLM(
        qwen3_path, num_kvcache_blocks=64, speculative_config=draft_config(qwen3_path)
    )
    params = SamplingParams(
        temperature=0.8, top_p=0.9, max_tokens=30, seed=7, ignore_eos=True
    )
    alone = completions(llm, prompts()[4:], params)
    together = completions(llm, prompts(), [GREEDY] * 4 + [params])
    assert together[4] == alone[0] == completions(llm, prompts()[4:], params)[0]
    assert llm.stats().num_accepted_tokens > 0
    assert_pool_whole(llm)


# ---- blocks ----


def test_lookahead_reserves_blocks_and_trim_gives_back_the_rejected_ones():
    manager = BlockManager(16, 4)
    seq = Sequence(list(range(6)), SamplingParams())
    assert manager.allocate(seq)
    manager.cache_full_blocks(seq, 6)
    seq.num_computed_tokens = 6
    seq.token_ids.append(6)  # sampled: position 6 runs next, with 5 proposals at 7..11
    manager.may_append(seq)
    assert manager.reserve(seq, 5) == 5
    assert len(seq.block_table) == 3 and manager.num_free_blocks == 13
    seq.num_computed_tokens += 1
    seq.token_ids += [7, 8, 99]  # 2 proposals accepted, then a token of the model's own
    manager.trim(seq)
    # position 9 runs next
    assert seq.num_computed_tokens == 9 and len(seq.block_table) == 3
    # the block of positions 4..7 is full of accepted tokens: cached; 8..11 is not full
    assert [manager.hashes[b] is not None for b in seq.block_table] == [
        True,
        True,
        False,
    ]
    manager.may_append(seq)
    assert manager.reserve(seq, 3) == 3  # 10..12: a block
    assert len(seq.block_table) == 4
    seq.num_computed_tokens += 1
    seq.token_ids.append(55)  # none accepted: the new block goes back
    manager.trim(seq)
    assert len(seq.block_table) == 3 and manager.num_free_blocks == 13
    # with one free block left, a reservation gets what it holds
    others = [manager._take_free_block() for _ in range(12)]
    manager.may_append(seq)
    assert manager.reserve(seq, 8) == 5  # 11, then 12..15
    assert manager.num_free_blocks == 0 and len(others) == 12


def test_a_failed_speculative_step_leaves_the_engine_correct(
    qwen3_path, hf_greedy, monkeypatch
):
    llm = LLM(
        qwen3_path, num_kvcache_blocks=64, speculative_config=draft_config(qwen3_path)
    )
    calls, apply = [], SpeculativeEngine.apply

    def failing(self, step, *args):
        calls.append(bool(step.proposals))
        if sum(calls) == 3:  # the third step that verifies proposals
            raise RuntimeError("injected")
        return apply(self, step, *args)

    monkeypatch.setattr(SpeculativeEngine, "apply", failing)
    with pytest.raises(RuntimeError, match="injected"):
        llm.generate(as_inputs(prompts()), GREEDY, use_tqdm=False)
    assert_pool_whole(llm)
    monkeypatch.setattr(SpeculativeEngine, "apply", apply)
    assert completions(llm, prompts(), GREEDY) == hf_greedy(qwen3_path, prompts(), 40)
