"""Async scheduling (nanopaged/async_scheduling.py): with the model run on a thread of
its own (`DeviceThread`, a CPU's stand-in for a GPU stream), so that the overlap is
real, the tokens are those of the synchronous engine (greedy and seeded) and of
transformers, whatever the scheduling does; failures and Ctrl-C leave the cache correct;
what reads the tokens so far falls back to synchronous steps."""

import threading

import pytest
import torch
from conftest import random_prompts
from test_reliability import (
    GREEDY,
    INTERRUPT_OPTIONS,
    INTERRUPT_PROMPTS,
    Boom,
    assert_engine_is_clean,
    completions,
    first_layer_raises,
    fresh_engine,
    nth,
)

from nanopaged import LLM, SamplingParams
from nanopaged.async_scheduling import AsyncEngine, DeviceThread
from nanopaged.core.llm_engine import LLMEngine

PROMPTS = random_prompts([40, 7, 70, 33, 90, 12], seed=60)
# a shared prefix of two blocks: prefix hits
PROMPTS += [PROMPTS[0][:32] + tail for tail in random_prompts([5, 20], seed=61)]
# small enough for chunked prefill and preemption
OPTIONS = dict(num_kvcache_blocks=24, max_num_batched_tokens=48)


def both(qwen3_path, prompts, params, **options) -> tuple[list, list, LLM]:
    """The outputs of the synchronous engine and of the overlapping one."""
    outputs = []
    for overlap in (False, True):
        llm = fresh_engine(qwen3_path, async_scheduling=overlap, **options)
        outputs.append(llm.generate(prompts, params, use_tqdm=False))
    assert isinstance(llm.engine, AsyncEngine)
    assert isinstance(llm.engine.runner, DeviceThread)
    return *outputs, llm


def texts(outputs) -> list[tuple]:
    return [(o.outputs[0].text, o.outputs[0].finish_reason) for o in outputs]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_tokens_equal_the_synchronous_engine_greedy_and_seeded(qwen3_path, temperature):
    """With chunked prefill, preemption and prefix hits in the run; n > 1 too."""
    params = [
        SamplingParams(
            temperature=temperature, max_tokens=24, ignore_eos=True, seed=i, n=1 + i % 2
        )
        for i in range(len(PROMPTS))
    ]
    sync, overlap, llm = both(qwen3_path, PROMPTS, params, **OPTIONS)
    assert [[c.token_ids for c in o.outputs] for o in overlap] == [
        [c.token_ids for c in o.outputs] for o in sync
    ]
    assert llm.engine.scheduler.num_preemptions > 0
    assert sum(o.num_cached_tokens for o in overlap) > 0
    assert_engine_is_clean(llm)


@pytest.mark.parametrize("max_tokens", [1, 2, 7])
def test_stop_tokens_strings_and_lengths_end_where_the_synchronous_engine_ends(
    qwen3_path, max_tokens
):
    """A sequence that stops at step n has a wasted row in n+1: its token is dropped,
    its output the same."""
    greedy = fresh_engine(qwen3_path).generate(PROMPTS[:4], GREEDY, use_tqdm=False)
    stop_token = greedy[0].outputs[0].token_ids[3]
    stop_text = greedy[1].outputs[0].text[2:4]
    params = [
        SamplingParams(
            temperature=0, max_tokens=max_tokens, stop_token_ids=[stop_token]
        ),
        SamplingParams(temperature=0, max_tokens=max_tokens, stop=[stop_text]),
        SamplingParams(temperature=0.7, max_tokens=max_tokens, seed=3),
        SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
    ]
    sync, overlap, llm = both(qwen3_path, PROMPTS[:4], params)
    assert completions(overlap) == completions(sync)
    assert texts(overlap) == texts(sync)
    assert_engine_is_clean(llm)


def test_the_next_step_is_launched_before_the_previous_one_has_finished(qwen3_path):
    """The host schedules and launches step n+1 while the device thread still runs n:
    a device that will not finish a step until the next one is launched completes."""
    llm = fresh_engine(qwen3_path, async_scheduling=True)
    runner = llm.engine.runner
    launched_next = threading.Event()
    start, launch = runner._start, runner.launch
    overlapped = []

    def slow_start(launched, pending):
        overlapped.append(launched_next.wait(timeout=10))
        launched_next.clear()
        start(launched, pending)

    def noting_launch(step, pending=None):
        result = launch(step, pending)
        launched_next.set()
        return result

    runner._start, runner.launch = slow_start, noting_launch
    llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False)
    # every step but the last found its successor launched before it ran
    assert overlapped[:-1] and all(overlapped[1:-1])


def test_an_abort_mid_run_drops_its_tokens_and_the_others_go_on(qwen3_path, hf_greedy):
    llm = fresh_engine(qwen3_path, async_scheduling=True)
    prompts = INTERRUPT_PROMPTS[:3]
    ids = [llm.add_request(prompt, GREEDY) for prompt in prompts]
    outputs = {}
    for _ in range(4):
        llm.step()
    llm.abort(ids[1])  # its step is in flight
    while not llm.is_finished():
        for output in llm.step():
            outputs[output.request_id] = output
    assert ids[1] not in outputs
    expected = hf_greedy(qwen3_path, [prompts[0], prompts[2]], 24)
    assert completions([outputs[ids[0]], outputs[ids[2]]]) == expected
    assert_engine_is_clean(llm)


@pytest.mark.parametrize("error", [Boom, KeyboardInterrupt])
@pytest.mark.parametrize("when", [("prefill", 2), ("decode", 3)])
def test_a_failure_in_either_step_leaves_the_cache_correct(
    qwen3_path, hf_greedy, error, when
):
    """A failure on the device's thread (or Ctrl-C) rolls back both steps in flight:
    the next requests get transformers' tokens from a clean pool."""
    llm = fresh_engine(qwen3_path, async_scheduling=True, **INTERRUPT_OPTIONS)
    with first_layer_raises(llm, error, nth(*when)), pytest.raises(error):
        llm.generate(INTERRUPT_PROMPTS, GREEDY, use_tqdm=False)
    assert_engine_is_clean(llm)
    outputs = llm.generate(INTERRUPT_PROMPTS, GREEDY, use_tqdm=False)
    assert completions(outputs) == hf_greedy(qwen3_path, INTERRUPT_PROMPTS, 24)


def test_ctrl_c_on_the_host_while_a_step_is_in_flight(qwen3_path, hf_greedy):
    llm = fresh_engine(qwen3_path, async_scheduling=True, **INTERRUPT_OPTIONS)
    collect, calls = llm.engine.runner.collect, []

    def interrupted(launched):
        calls.append(launched)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return collect(launched)

    llm.engine.runner.collect = interrupted
    with pytest.raises(KeyboardInterrupt):
        llm.generate(INTERRUPT_PROMPTS, GREEDY, use_tqdm=False)
    assert_engine_is_clean(llm)
    llm.engine.runner.collect = collect
    outputs = llm.generate(INTERRUPT_PROMPTS, GREEDY, use_tqdm=False)
    assert completions(outputs) == hf_greedy(qwen3_path, INTERRUPT_PROMPTS, 24)


def test_blocks_a_pending_token_filled_are_cached_once_it_is_known(qwen3_path):
    """A prompt that repeats a first request's prompt and answer hits the blocks the
    answer filled, as with synchronous steps."""
    cached = []
    for overlap in (False, True):
        llm = fresh_engine(qwen3_path, async_scheduling=overlap)
        [first] = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
        again = first.prompt_token_ids + first.outputs[0].token_ids + [5]
        [second] = llm.generate([again], GREEDY, use_tqdm=False)
        cached.append(second.num_cached_tokens)
    # the prompt's two full blocks, and the one the answer's first 8 tokens filled
    assert cached[0] == cached[1] == 48


def test_steps_whose_sampling_reads_the_tokens_run_synchronously(qwen3_path):
    """Penalties and logits processors read the tokens so far: while such a sequence
    runs, each step is the core's; the tokens are the synchronous engine's, also for the
    plain requests beside them."""
    penalized = SamplingParams(
        temperature=0, max_tokens=24, repetition_penalty=1.3, ignore_eos=True
    )
    params = [penalized, GREEDY, GREEDY]
    sync, overlap, llm = both(qwen3_path, PROMPTS[:3], params)
    assert completions(overlap) == completions(sync)


def test_speculation_and_the_trace_run_their_own_synchronous_engines(
    qwen3_path, tmp_path
):
    speculative = LLM(
        qwen3_path,
        async_scheduling=True,
        speculative_config={"method": "ngram", "num_speculative_tokens": 2},
    )
    assert not isinstance(speculative.engine, AsyncEngine)
    traced = LLM(qwen3_path, async_scheduling=True, trace=str(tmp_path / "t.jsonl"))
    assert type(traced.engine) is LLMEngine
    with pytest.raises(ValueError, match="tensor_parallel_size > 1"):
        LLM(qwen3_path, async_scheduling=True, tensor_parallel_size=2)


def test_pooling_beside_generation_pools_as_the_synchronous_engine(qwen3_path):
    """A prompt never sampled ends with the step that runs it; its hidden states are
    the step's."""
    from nanopaged.core.sequence import SamplingOptions, Sequence

    hidden = []
    for overlap in (False, True):
        llm = fresh_engine(qwen3_path, async_scheduling=overlap)
        pooled = Sequence(PROMPTS[1], SamplingOptions(max_tokens=0))
        pooled.hidden_states = True
        for prompt in PROMPTS[:3]:
            llm.add_request(prompt, GREEDY)
        llm.engine.add(pooled)
        rows = None
        while not llm.is_finished():
            step, sampled = llm.engine.step()
            llm.take(step, sampled)
            if pooled in step.seqs:
                i = step.seqs.index(pooled)
                first = sum(step.num_tokens[:i])
                rows = sampled.hidden_states[first : first + len(PROMPTS[1])].clone()
        assert pooled.finish_reason == "length"
        hidden.append(rows)
    assert torch.allclose(hidden[0], hidden[1])
