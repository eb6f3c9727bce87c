"""Greedy outputs are token-for-token those of transformers, however the engine gets
there."""

import re

import pytest
from conftest import ARCHITECTURES, added_text, random_prompts

from nanopaged import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24)
PROMPTS = random_prompts([1, 5, 17, 40, 100, 3])


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_matches_transformers(arch, model_path, hf_greedy):
    path = model_path(arch)
    outputs = LLM(path, max_model_len=512).generate(PROMPTS, GREEDY, use_tqdm=False)
    assert token_ids(outputs) == hf_greedy(path, PROMPTS, GREEDY.max_tokens)


def test_outputs_carry_text_and_finish_reason(qwen3_path, hf_greedy):
    llm = LLM(qwen3_path, max_model_len=512)
    [out] = llm.generate(
        ["Paged attention stores the cache in blocks."],
        SamplingParams(temperature=0, max_tokens=8),
        use_tqdm=False,
    )
    assert out.outputs[0].finish_reason in ("stop", "length")
    assert out.outputs[0].text == added_text(
        llm.tokenizer, out.prompt_token_ids, out.outputs[0].token_ids
    )
    assert (
        out.outputs[0].token_ids == hf_greedy(qwen3_path, [out.prompt_token_ids], 8)[0]
    )


def test_stops_at_eos_unless_ignore_eos(qwen3_path):
    llm = LLM(qwen3_path, max_model_len=512)
    eos = next(iter(llm.inputs.eos_token_ids))
    prompts = random_prompts([4] * 32, seed=1)
    outputs = llm.generate(
        prompts, SamplingParams(temperature=1.0, max_tokens=300, seed=0), use_tqdm=False
    )
    stopped = [o for o in outputs if o.outputs[0].finish_reason == "stop"]
    assert stopped and all(o.outputs[0].token_ids[-1] == eos for o in stopped)
    outputs = llm.generate(
        prompts,
        SamplingParams(temperature=1.0, max_tokens=300, seed=0, ignore_eos=True),
        use_tqdm=False,
    )
    assert all(
        o.outputs[0].finish_reason == "length" and len(o.outputs[0].token_ids) == 300
        for o in outputs
    )


def test_stops_at_max_model_len(qwen3_path):
    llm = LLM(qwen3_path, max_model_len=64)
    [out] = llm.generate(
        [list(range(3, 53))],
        SamplingParams(temperature=0, max_tokens=100, ignore_eos=True),
        use_tqdm=False,
    )
    assert (
        out.outputs[0].finish_reason == "length"
        and len(out.outputs[0].token_ids) == 64 - 50
    )


@pytest.mark.parametrize("block_size", [1, 16, 256])
def test_block_sizes(block_size, qwen3_path, hf_greedy):
    llm = LLM(qwen3_path, max_model_len=512, kvcache_block_size=block_size)
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert token_ids(outputs) == hf_greedy(qwen3_path, PROMPTS, GREEDY.max_tokens)


def test_prefix_cache_hits_give_the_same_tokens(qwen3_path, hf_greedy):
    block_size = 16
    shared = random_prompts([40], seed=2)[0]
    prompts = [shared + tail for tail in random_prompts([3, 20, 9], seed=3)]
    exact_multiple = random_prompts([2 * block_size], seed=4)[0]
    llm = LLM(qwen3_path, max_model_len=512, kvcache_block_size=block_size)
    first = llm.generate(prompts[:1] + [exact_multiple], GREEDY, use_tqdm=False)
    second = llm.generate(
        prompts + [exact_multiple, exact_multiple], GREEDY, use_tqdm=False
    )
    expected = hf_greedy(qwen3_path, prompts + [exact_multiple] * 2, GREEDY.max_tokens)
    assert token_ids(second) == expected
    assert first[0].outputs[0].token_ids == expected[0]
    # the shared 40 tokens fill two whole blocks; an exact multiple still computes its
    # last block
    assert [o.num_cached_tokens for o in second] == [32, 32, 32, block_size, block_size]


def test_identical_prompts_in_one_step_share_blocks(qwen3_path, hf_greedy):
    prompt = random_prompts([50], seed=5)[0]
    llm = LLM(qwen3_path, max_model_len=512, kvcache_block_size=16)
    outputs = llm.generate([prompt] * 3, GREEDY, use_tqdm=False)
    assert token_ids(outputs) == hf_greedy(qwen3_path, [prompt] * 3, GREEDY.max_tokens)
    assert [o.num_cached_tokens for o in outputs] == [0, 48, 48]


def test_preemption_gives_the_same_tokens(qwen3_path, hf_greedy):
    prompts = random_prompts([30, 45, 12, 60, 25, 38], seed=6)
    params = SamplingParams(temperature=0, max_tokens=40)
    # 12 blocks of 16 tokens cannot hold six sequences of 50-100 tokens at once
    llm = LLM(
        qwen3_path, max_model_len=512, kvcache_block_size=16, num_kvcache_blocks=12
    )
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert token_ids(outputs) == hf_greedy(qwen3_path, prompts, params.max_tokens)
    assert llm.engine.block_manager.num_free_blocks == 12


def test_chunked_prefill_gives_the_same_tokens(qwen3_path, hf_greedy):
    prompts = random_prompts([100, 37, 64, 5], seed=7)
    llm = LLM(
        qwen3_path, max_model_len=512, kvcache_block_size=16, max_num_batched_tokens=24
    )
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert token_ids(outputs) == hf_greedy(qwen3_path, prompts, GREEDY.max_tokens)


def test_max_num_seqs_limits_the_batch(qwen3_path, hf_greedy):
    """No step runs more than max_num_seqs sequences; the others wait their turn."""
    llm = LLM(qwen3_path, max_model_len=512, max_num_seqs=2)
    sizes = []
    launch = llm.engine.runner.launch
    llm.engine.runner.launch = lambda step, pending=None: (
        sizes.append(len(step.seqs)) or launch(step, pending)
    )
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert token_ids(outputs) == hf_greedy(qwen3_path, PROMPTS, GREEDY.max_tokens)
    assert max(sizes) == 2 and len(PROMPTS) > 2


def test_step_api(qwen3_path, hf_greedy):
    llm = LLM(qwen3_path, max_model_len=512)
    assert llm.step() == [] and llm.is_finished()
    ids = [llm.add_request(p, GREEDY) for p in PROMPTS[:3]]
    outputs = {}
    while not llm.is_finished():
        outputs.update({o.request_id: o for o in llm.step()})
    assert all(outputs[i].finished for i in ids)
    assert [outputs[i].outputs[0].token_ids for i in ids] == hf_greedy(
        qwen3_path, PROMPTS[:3], GREEDY.max_tokens
    )
    assert llm.step() == []


def test_generate_refuses_while_step_api_requests_are_unfinished(qwen3_path, hf_greedy):
    llm = LLM(qwen3_path, max_model_len=512)
    request_id = llm.add_request(PROMPTS[0], GREEDY)
    with pytest.raises(
        ValueError, match="1 requests added with add_request.* are unfinished"
    ):
        llm.generate(PROMPTS[1:2], GREEDY, use_tqdm=False)
    outputs = []
    while not llm.is_finished():
        outputs += llm.step()
    assert outputs[-1].request_id == request_id and outputs[-1].finished
    assert (
        outputs[-1].outputs[0].token_ids
        == hf_greedy(qwen3_path, PROMPTS[:1], GREEDY.max_tokens)[0]
    )


def test_triton_backend_matches_transformers(qwen3_path, hf_greedy):
    pytest.importorskip("triton")
    prompts = PROMPTS[:4]
    params = SamplingParams(temperature=0, max_tokens=8)
    llm = LLM(
        qwen3_path, max_model_len=512, attention_backend="triton", kvcache_block_size=16
    )
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert token_ids(outputs) == hf_greedy(qwen3_path, prompts, params.max_tokens)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_mixed_scheduling_gives_the_tokens_of_prefill_first(
    backend, qwen3_path, hf_greedy
):
    """Requests arrive while others decode; `mixed` runs their prompt chunks beside the
    decodes."""
    if backend == "triton":
        pytest.importorskip("triton")
    prompts = random_prompts([70, 9, 45, 30], seed=8)
    params = SamplingParams(temperature=0, max_tokens=12)
    llm = LLM(
        qwen3_path,
        max_model_len=512,
        kvcache_block_size=16,
        attention_backend=backend,
        scheduling="mixed",
        max_num_batched_tokens=32,
    )
    launch, step_kinds = llm.engine.runner.launch, set()

    def recording_launch(step, pending=None):
        decodes = any(
            n == 1 and s.num_completion_tokens
            for s, n in zip(step.seqs, step.num_tokens)
        )
        step_kinds.add((step.ragged, decodes))
        return launch(step, pending)

    llm.engine.runner.launch = recording_launch
    ids = [llm.add_request(p, params) for p in prompts[:2]]
    outputs = {}
    for step in range(40):
        if step == 3:  # two more arrive while the first two decode
            ids += [llm.add_request(p, params) for p in prompts[2:]]
        outputs.update({o.request_id: o for o in llm.step() if o.finished})
    # a step mixed a prompt and decodes
    assert llm.is_finished() and (True, True) in step_kinds
    assert [outputs[i].outputs[0].token_ids for i in ids] == hf_greedy(
        qwen3_path, prompts, 12
    )


def test_mixed_steps_of_one_prompt_token_beside_decodes(qwen3_path, hf_greedy):
    """A budget that leaves one token a step for a prompt: a token inside the prompt,
    then its last one, whose row its second sample shares, beside the decodes of the
    others."""
    prompts = random_prompts([6, 9, 5], seed=9)
    llm = LLM(
        qwen3_path,
        max_model_len=512,
        kvcache_block_size=4,
        scheduling="mixed",
        max_num_batched_tokens=3,
    )
    params = SamplingParams(temperature=0, max_tokens=10)
    ids = [llm.add_request(p, params) for p in prompts[:2]]
    outputs = {}
    for _ in range(8):  # both prompts are in; both decode
        outputs.update({o.request_id: o for o in llm.step()})
    ids.append(
        llm.add_request(prompts[2], SamplingParams(temperature=0, max_tokens=10, n=2))
    )
    while not llm.is_finished():
        outputs.update({o.request_id: o for o in llm.step()})
    expected = hf_greedy(qwen3_path, prompts, 10)
    assert [outputs[i].outputs[0].token_ids for i in ids] == expected
    assert outputs[ids[2]].outputs[1].token_ids == expected[2]


def test_the_progress_bar_shows_the_prefill_and_decode_rates(
    qwen3_path, capsys, monkeypatch
):
    """The bar shows each kind's last step: its tokens over its seconds (here on a clock
    that ticks one second a reading: each step reads it twice more, then ends)."""
    import itertools

    import nanopaged.engine.llm

    llm = LLM(qwen3_path, max_model_len=512)
    clock = itertools.count()
    monkeypatch.setattr(nanopaged.engine.llm.time, "perf_counter", lambda: next(clock))
    last, run_step = {}, llm.run_step

    def recording():
        step, requests = run_step()
        last["prefill" if step.ragged else "decode"] = step.num_scheduled_tokens
        return step, requests

    monkeypatch.setattr(llm, "run_step", recording)
    llm.generate(PROMPTS, GREEDY, use_tqdm=True)
    bar = capsys.readouterr().err
    assert "Generating: 100%" in bar and f"{len(PROMPTS)}/{len(PROMPTS)}" in bar
    shown = re.findall(r"prefill ([\d,]+) tok/s, decode ([\d,]+) tok/s", bar)[-1]
    assert shown == (f"{last['prefill'] / 2:,.0f}", f"{last['decode'] / 2:,.0f}")


def test_the_progress_bar_counts_each_request_once_when_its_last_sample_ends(
    qwen3_path, capsys
):
    """Requests of two samples each, of different lengths: the bar counts a request when
    both its samples have ended, never twice."""
    llm = LLM(qwen3_path, max_model_len=512)
    params = [
        SamplingParams(n=2, temperature=1.0, max_tokens=m, ignore_eos=True)
        for m in (3, 9, 5, 1)
    ]
    llm.generate(PROMPTS[:4], params, use_tqdm=True)
    counts = [int(n) for n in re.findall(r"(\d+)/4 \[", capsys.readouterr().err)]
    assert counts[-1] == 4 and counts == sorted(counts) and max(counts) == 4


def test_chat_and_stream_refuse_too_while_step_api_requests_are_unfinished(qwen3_path):
    llm = LLM(qwen3_path, max_model_len=512)
    llm.add_request(PROMPTS[0], GREEDY)
    for call in (
        lambda: llm.chat([{"role": "user", "content": "Hi"}], GREEDY),
        lambda: next(llm.stream("Hi", GREEDY)),
    ):
        with pytest.raises(
            ValueError, match="1 requests added with add_request.* unfinished"
        ):
            call()
    assert len(llm.requests) == 1 and len(llm.engine.scheduler.waiting) == 1


def test_a_cpu_pool_holds_max_num_seqs_sequences_of_max_model_len(qwen3_path):
    """On CPU the pool is what the batch can use at most (when RAM allows, as here)."""
    llm = LLM(qwen3_path, max_model_len=64, max_num_seqs=3, kvcache_block_size=16)
    assert llm.engine.block_manager.num_blocks == 3 * 64 // 16
