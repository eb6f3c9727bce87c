"""A step that fails or is interrupted leaves the engine as correct as before: the
prefix cache never serves K/V that was not written, the pool is whole, and later
requests get the right tokens.
"""

import os
import random
import sys
from contextlib import contextmanager

import pytest
from conftest import random_prompts

from nanopaged import LLM, SamplingParams
from nanopaged.outputs import Request

BLOCK = 16
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


class Boom(Exception):
    pass


@contextmanager
def first_layer_raises(llm, error: type[BaseException], should_fail):
    """Makes the model's first layer raise `error` on the calls for which
    `should_fail(meta)`; its decode steps run eagerly meanwhile (a CPU's step graph
    replays its C calls, not the layer's Python)."""
    runner = llm.engine.runner
    layer, graphs = runner.model.model.layers[0], runner.graphs
    forward = layer.forward

    def failing_forward(positions, hidden, residual, meta):
        if should_fail(meta):
            raise error("injected failure")
        return forward(positions, hidden, residual, meta)

    layer.forward, runner.graphs = failing_forward, None
    try:
        yield
    finally:
        del layer.forward
        runner.graphs = graphs


def nth(kind: str, n: int):
    """should_fail for the n-th (from 1) prefill or decode forward."""
    calls = {"prefill": 0, "decode": 0}

    def should_fail(meta):
        key = "prefill" if meta.ragged else "decode"
        calls[key] += 1
        return key == kind and calls[key] == n

    return should_fail


def fresh_engine(qwen3_path, **options) -> LLM:
    llm = LLM(qwen3_path, max_model_len=512, kvcache_block_size=BLOCK, **options)
    # slots that were never written hold noise, not zeros: serving one changes the
    # tokens
    llm.engine.runner.kv_cache.normal_(0, 100)
    return llm


def assert_engine_is_clean(llm) -> None:
    assert llm.is_finished() and not llm.requests
    assert (
        llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    )
    assert not any(llm.engine.block_manager.ref_counts)
    assert not llm.engine.block_manager.uncommitted


def completions(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("error", [Boom, KeyboardInterrupt])
def test_a_failed_prefill_leaves_no_stale_prefix(qwen3_path, hf_greedy, error):
    llm = fresh_engine(qwen3_path)
    prompts = random_prompts([40, 33], seed=30)
    seeded = SamplingParams(temperature=1.0, max_tokens=24, seed=5)
    with first_layer_raises(llm, error, nth("prefill", 1)), pytest.raises(error):
        llm.generate(prompts, [GREEDY, seeded], use_tqdm=False)
    assert_engine_is_clean(llm)
    assert completions(llm.generate(prompts, GREEDY, use_tqdm=False)) == hf_greedy(
        qwen3_path, prompts, 24
    )


def test_a_failed_decode_leaves_no_stale_block(qwen3_path, hf_greedy):
    llm = fresh_engine(qwen3_path)
    prompt = random_prompts([30], seed=31)[0]
    expected = hf_greedy(qwen3_path, [prompt], 24)[0]
    # decode step 2 runs position 31, the last of block 1: the step would have filled
    # the block
    with first_layer_raises(llm, Boom, nth("decode", 2)), pytest.raises(Boom):
        llm.generate([prompt], GREEDY, use_tqdm=False)
    assert_engine_is_clean(llm)
    # its first two blocks are those the failed step named
    longer = prompt + expected[:10]
    outputs = llm.generate([prompt, longer], GREEDY, use_tqdm=False)
    assert completions(outputs) == hf_greedy(qwen3_path, [prompt, longer], 24)


def test_a_failed_prefill_chunk_leaves_no_stale_block(qwen3_path, hf_greedy):
    llm = fresh_engine(qwen3_path, max_num_batched_tokens=24)
    prompt = random_prompts([70], seed=32)[0]
    with first_layer_raises(llm, Boom, nth("prefill", 2)), pytest.raises(Boom):
        llm.generate([prompt], GREEDY, use_tqdm=False)
    assert_engine_is_clean(llm)
    [output] = llm.generate([prompt], GREEDY, use_tqdm=False)
    assert output.outputs[0].token_ids == hf_greedy(qwen3_path, [prompt], 24)[0]
    # the first chunk's block, which was written
    assert output.num_cached_tokens == BLOCK


def test_a_failed_step_aborts_step_api_requests_and_the_engine_goes_on(
    qwen3_path, hf_greedy
):
    llm = fresh_engine(qwen3_path)
    prompts = random_prompts([20, 50], seed=33)
    for prompt in prompts:
        llm.add_request(prompt, GREEDY)
    with first_layer_raises(llm, Boom, nth("decode", 3)), pytest.raises(Boom):
        while not llm.is_finished():
            llm.step()
    assert_engine_is_clean(llm)
    assert llm.step() == []
    assert completions(llm.generate(prompts, GREEDY, use_tqdm=False)) == hf_greedy(
        qwen3_path, prompts, 24
    )


@contextmanager
def interrupted_at_line(n: int | None):
    """Raises KeyboardInterrupt at the n-th line nanopaged runs (as Ctrl-C at that
    moment would); with n None, only counts the lines. Yields the (file, function) of
    each line run."""
    lines = []

    def trace_line(frame, event, arg):
        if event == "line":
            lines.append(
                (os.path.basename(frame.f_code.co_filename), frame.f_code.co_name)
            )
            if len(lines) == n:
                raise KeyboardInterrupt
        return trace_line

    sys.settrace(
        lambda frame, event, arg: (
            trace_line if "nanopaged" in frame.f_code.co_filename else None
        )
    )
    try:
        yield lines
    finally:
        sys.settrace(None)


def moments(lines: list[tuple[str, str]], where, count: int, seed: int) -> list[int]:
    """`count` of the line numbers (from 1) whose (file, function) satisfies `where`."""
    candidates = [i + 1 for i, line in enumerate(lines) if where(*line)]
    return random.Random(seed).sample(candidates, min(count, len(candidates)))


INTERRUPT_PROMPTS = random_prompts([40, 70, 33], seed=34)
INTERRUPT_PROMPTS += [
    INTERRUPT_PROMPTS[0][:32] + tail for tail in random_prompts([5, 20], seed=35)
]
# preemption and chunks too
INTERRUPT_OPTIONS = dict(num_kvcache_blocks=12, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def traced_generate(qwen3_path):
    """The (file, function) of every line an uninterrupted `generate` runs."""
    llm = fresh_engine(qwen3_path, **INTERRUPT_OPTIONS)
    with interrupted_at_line(None) as lines:
        llm.generate(INTERRUPT_PROMPTS, GREEDY, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    return lines


def assert_ctrl_c_at_each_moment_is_harmless(
    qwen3_path, hf_greedy, at: list[int]
) -> None:
    expected = hf_greedy(qwen3_path, INTERRUPT_PROMPTS, 24)
    for n in at:
        # a cold cache, filled by the run
        llm = fresh_engine(qwen3_path, **INTERRUPT_OPTIONS)
        with interrupted_at_line(n), pytest.raises(KeyboardInterrupt):
            llm.generate(INTERRUPT_PROMPTS, GREEDY, use_tqdm=False)
        assert_engine_is_clean(llm)
        assert (
            completions(llm.generate(INTERRUPT_PROMPTS, GREEDY, use_tqdm=False))
            == expected
        )


def test_ctrl_c_at_random_moments_never_corrupts_later_requests(
    qwen3_path, hf_greedy, traced_generate
):
    # most moments fall among the first prompts' steps, where a stale prefix would be
    # made
    early = moments(
        traced_generate[: len(traced_generate) // 8], lambda *_: True, 8, seed=0
    )
    anywhere = moments(traced_generate, lambda *_: True, 4, seed=1)
    assert_ctrl_c_at_each_moment_is_harmless(qwen3_path, hf_greedy, early + anywhere)


def test_ctrl_c_inside_the_prefix_cache_bookkeeping_is_harmless(
    qwen3_path, hf_greedy, traced_generate
):
    """Every line of the first calls that enter a block's hash, and of the first
    rollbacks' neighbours: the scheduler and the block manager at random."""
    first_cache_blocks = [
        i + 1
        for i, line in enumerate(traced_generate)
        if line == ("block_manager.py", "_cache_block")
    ][:12]
    pool = moments(
        traced_generate,
        lambda file, _: file in ("block_manager.py", "scheduler.py"),
        10,
        seed=2,
    )
    assert_ctrl_c_at_each_moment_is_harmless(
        qwen3_path, hf_greedy, first_cache_blocks + pool
    )


def test_ctrl_c_outside_the_step_loop_is_harmless(
    qwen3_path, hf_greedy, traced_generate
):
    """While requests are checked and queued, and while their outputs are built."""
    outside = moments(
        traced_generate,
        lambda file, function: (
            file in ("outputs.py", "inputs.py")
            or function in ("generate", "_enqueue", "_output", "_run")
        ),
        10,
        seed=3,
    )
    assert_ctrl_c_at_each_moment_is_harmless(qwen3_path, hf_greedy, outside)


def test_ctrl_c_while_streaming_is_harmless(qwen3_path, hf_greedy):
    prompt = INTERRUPT_PROMPTS[1]
    params = SamplingParams(
        temperature=0, max_tokens=24, ignore_eos=True, stop=["never"]
    )
    llm = fresh_engine(qwen3_path, **INTERRUPT_OPTIONS)
    with interrupted_at_line(None) as lines:
        "".join(llm.stream(prompt, params))
    for n in moments(lines, lambda *_: True, 8, seed=4):
        llm = fresh_engine(qwen3_path, **INTERRUPT_OPTIONS)
        with interrupted_at_line(n), pytest.raises(KeyboardInterrupt):
            "".join(llm.stream(prompt, params))
        assert_engine_is_clean(llm)
        [output] = llm.generate([prompt], params, use_tqdm=False)
        assert output.outputs[0].token_ids == hf_greedy(qwen3_path, [prompt], 24)[0]


def test_a_failure_in_one_requests_bookkeeping_ends_that_request_alone(
    qwen3_path, hf_greedy, monkeypatch
):
    """An exception while recording one request's token (its logprobs, its text) fails
    that request, with its error; the others in the same steps finish as they would
    alone."""
    llm = fresh_engine(qwen3_path)
    prompts = random_prompts([20, 30, 25], seed=36)
    take = Request._take_token

    def failing_take(self, index, position, token_id, logprobs):
        if self.request_id == "1" and position == 4:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return take(self, index, position, token_id, logprobs)

    monkeypatch.setattr(Request, "_take_token", failing_take)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    with pytest.warns(UserWarning, match="request 1 failed: UnicodeDecodeError"):
        outputs = llm.generate(prompts, params, use_tqdm=False)
    expected = hf_greedy(qwen3_path, prompts, 24)
    assert [completions(outputs)[i] for i in (0, 2)] == [expected[0], expected[2]]
    failed = outputs[1]
    assert failed.finished and failed.outputs[0].finish_reason == "abort"
    assert "injected" in failed.error and failed.outputs[0].token_ids == expected[1][:5]
    assert_engine_is_clean(llm)


@pytest.mark.parametrize("where", ["logprobs", "stop strings", "outputs"])
def test_an_interrupt_after_the_core_step_aborts_every_request(
    qwen3_path, hf_greedy, monkeypatch, where
):
    """Ctrl-C in the layer above the core (logprobs, stop strings, the outputs' text)
    after its step ran: every request ends, and the engine gives the right tokens and
    logprobs on."""
    from nanopaged.engine import llm as llm_module

    targets = {
        "logprobs": (llm_module, "token_logprobs"),
        "stop strings": (Request, "take_tokens"),
        "outputs": (Request, "output"),
    }
    owner, name = targets[where]
    original = getattr(owner, name)
    calls = []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    prompts = random_prompts([5, 9, 14], seed=8)
    params = SamplingParams(
        temperature=0,
        max_tokens=8,
        ignore_eos=True,
        logprobs=2,
        stop=["§ no such text §"],
    )
    llm = fresh_engine(qwen3_path)
    for prompt in prompts:
        llm.add_request(prompt, params)
    monkeypatch.setattr(owner, name, interrupted)
    with pytest.raises(KeyboardInterrupt):
        while not llm.is_finished():
            llm.step()
    monkeypatch.setattr(owner, name, original)
    assert_engine_is_clean(llm)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(
        qwen3_path, prompts, 8
    )
    assert all(len(o.outputs[0].logprobs) == 8 for o in outputs)
