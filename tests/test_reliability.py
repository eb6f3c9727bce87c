"""A step that fails or is interrupted leaves the engine as correct as before: the prefix cache
never serves K/V that was not written, the pool is whole, and later requests get the right tokens."""
import random
import sys
from contextlib import contextmanager

import pytest

from nanopaged import LLM, SamplingParams
from conftest import random_prompts

BLOCK = 16
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


class Boom(Exception):
    pass


@contextmanager
def first_layer_raises(llm, error: type[BaseException], should_fail):
    """Makes the model's first layer raise `error` on the calls for which `should_fail(meta)`."""
    layer = llm.model_runner.model.model.layers[0]
    forward = layer.forward
    def failing_forward(positions, hidden, residual, meta):
        if should_fail(meta):
            raise error("injected failure")
        return forward(positions, hidden, residual, meta)
    layer.forward = failing_forward
    try:
        yield
    finally:
        del layer.forward


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
    # slots that were never written hold noise, not zeros: serving one changes the tokens
    llm.model_runner.kv_cache.normal_(0, 100)
    return llm


def assert_engine_is_clean(llm) -> None:
    assert llm.is_finished() and not llm.requests
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
    assert all(block.ref_count == 0 for block in llm.block_manager.blocks)
    assert not llm.block_manager.uncommitted


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
    assert completions(llm.generate(prompts, GREEDY, use_tqdm=False)) == hf_greedy(qwen3_path, prompts, 24)


def test_a_failed_decode_leaves_no_stale_block(qwen3_path, hf_greedy):
    llm = fresh_engine(qwen3_path)
    prompt = random_prompts([30], seed=31)[0]
    expected = hf_greedy(qwen3_path, [prompt], 24)[0]
    # decode step 2 runs position 31, the last of block 1: the step would have filled the block
    with first_layer_raises(llm, Boom, nth("decode", 2)), pytest.raises(Boom):
        llm.generate([prompt], GREEDY, use_tqdm=False)
    assert_engine_is_clean(llm)
    longer = prompt + expected[:10]  # its first two blocks are those the failed step named
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
    assert output.num_cached_tokens == BLOCK  # the first chunk's block, which was written


def test_a_failed_step_aborts_step_api_requests_and_the_engine_goes_on(qwen3_path, hf_greedy):
    llm = fresh_engine(qwen3_path)
    prompts = random_prompts([20, 50], seed=33)
    for prompt in prompts:
        llm.add_request(prompt, GREEDY)
    with first_layer_raises(llm, Boom, nth("decode", 3)), pytest.raises(Boom):
        while not llm.is_finished():
            llm.step()
    assert_engine_is_clean(llm)
    assert llm.step() == []
    assert completions(llm.generate(prompts, GREEDY, use_tqdm=False)) == hf_greedy(qwen3_path, prompts, 24)


@contextmanager
def interrupted_at_line(n: int | None):
    """Raises KeyboardInterrupt at the n-th line nanopaged runs (as Ctrl-C at that moment would);
    with n None, only counts the lines. Yields the count."""
    count = [0]
    def trace_line(frame, event, arg):
        if event == "line":
            count[0] += 1
            if count[0] == n:
                raise KeyboardInterrupt
        return trace_line
    sys.settrace(lambda frame, event, arg: trace_line if "nanopaged" in frame.f_code.co_filename else None)
    try:
        yield count
    finally:
        sys.settrace(None)


def test_ctrl_c_at_random_moments_never_corrupts_later_requests(qwen3_path, hf_greedy):
    prompts = random_prompts([40, 70, 33], seed=34)
    prompts += [prompts[0][:32] + tail for tail in random_prompts([5, 20], seed=35)]
    expected = hf_greedy(qwen3_path, prompts, 24)
    options = dict(num_kvcache_blocks=12, max_num_batched_tokens=64)  # preemption and chunks too
    llm = fresh_engine(qwen3_path, **options)
    with interrupted_at_line(None) as lines:
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.scheduler.num_preemptions > 0
    # most moments fall among the first prompts' steps, where a stale prefix would be made
    moments = random.Random(0)
    for n in moments.sample(range(1, lines[0] // 8), 8) + moments.sample(range(1, lines[0]), 4):
        llm = fresh_engine(qwen3_path, **options)  # a cold cache, filled by the interrupted run
        with interrupted_at_line(n), pytest.raises(KeyboardInterrupt):
            llm.generate(prompts, GREEDY, use_tqdm=False)
        assert_engine_is_clean(llm)
        assert completions(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
