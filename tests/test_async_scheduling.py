"""Async scheduling (nanopaged/async_scheduling.py): with the model run on a thread of
its own (`DeviceThread`, a CPU's stand-in for a GPU stream), so that the overlap is
real, the tokens are those of the synchronous engine (greedy and seeded) and of
transformers, whatever the scheduling does; failures and Ctrl-C leave the cache correct;
what reads the tokens so far falls back to synchronous steps."""

import os
import select
import signal
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
from nanopaged.async_scheduling import AsyncEngine
from nanopaged.core.llm_engine import LLMEngineCore
from nanopaged.core.sequence import PENDING
from nanopaged.cpu.device_thread import DeviceThread

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
    compute, launch = runner._compute, runner.launch
    overlapped = []

    def slow_compute(*work):
        overlapped.append(launched_next.wait(timeout=10))
        launched_next.clear()
        compute(*work)

    def noting_launch(step, pending=None):
        result = launch(step, pending)
        launched_next.set()
        return result

    runner._compute, runner.launch = slow_compute, noting_launch
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
    assert type(traced.engine) is LLMEngineCore
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


def test_logprobs_of_a_request_that_ended_a_step_before_are_not_asked_for(qwen3_path):
    """A sequence that ended at step n has a wasted row in n+1, with no token: a step
    whose only logprobs rows are such rows asks for none (in one batch, and on the call
    after a logprobs call)."""
    logprobs = SamplingParams(temperature=0, max_tokens=2, logprobs=3, ignore_eos=True)
    params = [logprobs, GREEDY]
    sync, overlap, llm = both(qwen3_path, PROMPTS[:2], params)
    assert completions(overlap) == completions(sync)
    for got, expected in zip(
        overlap[0].outputs[0].logprobs, sync[0].outputs[0].logprobs
    ):
        assert got.keys() == expected.keys()
    llm.generate(PROMPTS[:1], logprobs, use_tqdm=False)
    again = llm.generate(PROMPTS[1:2], GREEDY, use_tqdm=False)
    assert completions(again) == completions(sync[1:])


def test_pooling_gives_the_synchronous_engines_vectors(qwen3_path):
    """A pooling sequence ends with the step that runs it, launched but not yet read:
    the engine is finished only once it has read it."""
    texts = ["paged attention", "a block table maps blocks", "the sea"]
    vectors = []
    for overlap in (False, True):
        llm = LLM(qwen3_path, runner="pooling", async_scheduling=overlap)
        outputs = llm.embed(texts, use_tqdm=False)
        assert all(output.finished for output in outputs)
        vectors.append(torch.tensor([o.outputs.embedding for o in outputs]))
    assert isinstance(llm.engine, AsyncEngine)
    assert torch.allclose(vectors[0], vectors[1])


def test_ctrl_c_above_the_engine_forgets_the_step_in_flight(qwen3_path, hf_greedy):
    """Ctrl-C in the layer above the engine (its note of a step's tokens), while a
    prefill that entered hashes is in flight: the next call neither commits those
    hashes nor counts them as its own, so when its first step fails, no block it
    named is served later."""
    llm = fresh_engine(qwen3_path, async_scheduling=True)
    take = llm.take

    def interrupted(step, sampled):
        if llm.engine.entered:  # the step in flight entered hashes
            raise KeyboardInterrupt
        return take(step, sampled)

    llm.take = interrupted
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    del llm.take
    assert_engine_is_clean(llm)
    prompt = INTERRUPT_PROMPTS[0]  # 40 tokens: two full blocks

    def its_prefill(meta):  # not the step in flight, which may still run
        return meta.ragged and int(meta.cu_seqlens_q[-1]) == len(prompt)

    with first_layer_raises(llm, Boom, its_prefill), pytest.raises(Boom):
        llm.generate([prompt], GREEDY, use_tqdm=False)
    assert_engine_is_clean(llm)
    print("DBG", llm.engine.block_manager.hash_to_block, llm.engine.entered)
    [output] = llm.generate([prompt], GREEDY, use_tqdm=False)
    print("DBG", output.num_cached_tokens)
    assert output.num_cached_tokens == 0
    assert completions([output]) == hf_greedy(qwen3_path, [prompt], 24)


def test_a_call_returns_only_once_its_steps_have_run(qwen3_path, hf_greedy):
    """The last step of a call has only wasted rows (every sequence ended the step
    before): the call reads it before it returns, so its failure is that call's and
    the next call runs as if nothing happened."""
    llm = fresh_engine(qwen3_path, async_scheduling=True)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    # the prefill samples token 1, decodes 1-3 the rest: decode 4 is the wasted step
    with first_layer_raises(llm, Boom, nth("decode", 4)), pytest.raises(Boom):
        llm.generate(PROMPTS[:2], params, use_tqdm=False)
    assert not llm.engine.in_flight
    assert_engine_is_clean(llm)
    outputs = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    assert completions(outputs) == hf_greedy(qwen3_path, PROMPTS[:2], 24)


def test_a_failed_step_leaves_no_pending_token_in_any_sequence(qwen3_path):
    """Between two calls no sequence holds a pending token, also after a failure: the
    sequences it aborts keep only the tokens that were read."""
    llm = fresh_engine(qwen3_path, async_scheduling=True)
    for prompt in PROMPTS[:3]:
        llm.add_request(prompt, GREEDY)
    seqs = [seq for request in llm.requests.values() for seq in request.seqs]
    with first_layer_raises(llm, Boom, nth("decode", 3)), pytest.raises(Boom):
        while not llm.is_finished():
            llm.step()
    assert all(seq.finish_reason == "abort" for seq in seqs)
    assert all(PENDING not in seq.token_ids for seq in seqs)
    assert all(seq.num_completion_tokens > 0 for seq in seqs)


def test_a_block_is_cached_only_once_its_last_tokens_kv_is_computed(
    qwen3_path, hf_greedy
):
    """A block that a sequence's pending token filled, read while the step launched
    after it was a prefill that left the sequence out, holds no K/V for that token
    yet: a prompt that repeats it, prefilled next, gets no hit on that block and
    transformers' tokens."""
    llm = fresh_engine(qwen3_path, async_scheduling=True)
    prompt = PROMPTS[1][:7] + PROMPTS[0][:13]  # 20 tokens
    llm.add_request(prompt, GREEDY)
    for _ in range(12):  # the 12th call launches the step that samples position 31
        llm.step()
    llm.add_request(PROMPTS[5], GREEDY)  # prefilled next, on its own
    [output] = llm.step()  # reads position 31: its block is full
    assert len(output.outputs[0].token_ids) == 12
    [seq] = llm.requests[output.request_id].seqs
    assert seq not in llm.engine.in_flight[0].step.seqs
    repeat = prompt + output.outputs[0].token_ids + [5]
    llm.add_request(repeat, GREEDY, request_id="repeat")
    outputs = {}
    while not llm.is_finished():
        outputs.update((o.request_id, o) for o in llm.step() if o.finished)
    assert outputs["repeat"].num_cached_tokens == 16
    assert completions([outputs["repeat"]]) == hf_greedy(qwen3_path, [repeat], 24)


def test_the_device_thread_follows_the_programs_thread_count(qwen3_path):
    """`torch.set_num_threads` between two calls: the device's thread runs the next
    step with the new count (torch keeps a count per thread)."""
    llm = fresh_engine(qwen3_path, async_scheduling=True)
    runner, counts = llm.engine.runner, []
    execute = runner.execute

    def counting(*args, **kwargs):
        counts.append(torch.get_num_threads())
        return execute(*args, **kwargs)

    runner.execute = counting
    before = torch.get_num_threads()
    try:
        for threads in (before, 3 - before if before < 3 else 1):
            torch.set_num_threads(threads)
            counts.clear()
            llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
            assert set(counts) == {threads}
    finally:
        torch.set_num_threads(before)


def test_an_engine_goes_on_in_a_forked_child(qwen3_path):
    """After `os.fork()`, with a step in flight: the child starts its own device
    thread, runs that step again and gets the parent's tokens."""
    llm = fresh_engine(qwen3_path, async_scheduling=True)
    expected = completions(llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False))
    request_id = llm.add_request(PROMPTS[1], GREEDY)
    llm.step(), llm.step()  # the second step is in flight
    readable, writable = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its tokens, or its error, down the pipe
        try:
            outputs = [o for _ in range(100) for o in llm.step() if o.finished]
            again = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
            said = repr(completions(outputs) + completions(again))
        except BaseException as error:
            said = repr(error)
        os.write(writable, said.encode())
        os._exit(0)
    os.close(writable)
    try:
        ready, _, _ = select.select([readable], [], [], 60)
        said = os.read(readable, 1 << 16).decode() if ready else "no answer in 60 s"
    finally:
        os.close(readable)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert said == repr([expected[1], expected[0]])
    outputs = {}
    while not llm.is_finished():
        outputs.update((o.request_id, o) for o in llm.step() if o.finished)
    assert completions([outputs[request_id]]) == [expected[1]]
