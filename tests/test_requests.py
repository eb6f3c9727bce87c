"""Requests as people make them: logprobs, stop conditions, n samples sharing a prompt,
streamed text, abort, chat and model ids, each against transformers or a plain
reference."""

import shutil

import pytest
import torch
from conftest import ScriptedRunner, added_text, random_prompts

from nanopaged import LLM, SamplingParams

POEM = "Write a short poem about the sea."  # greedy: '�rselfche memory memory ...'


@pytest.fixture(scope="module")
def llm(qwen3_path):
    return LLM(qwen3_path, max_model_len=512, kvcache_block_size=16)


def hf_continuation(
    hf_model, path, prompt_ids, max_tokens, **generate_options
) -> list[int]:
    model = hf_model(path)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=0,
            **generate_options,
        )
    return out[0, len(prompt_ids) :].tolist()


# ---- logprobs ----


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_tokens=12, logprobs=5),
        SamplingParams(
            temperature=0.8, top_k=20, top_p=0.9, max_tokens=12, logprobs=3, seed=4
        ),
    ],
)
def test_logprobs_are_transformers_log_softmax(llm, qwen3_path, hf_model, params):
    prompts = random_prompts([7, 30], seed=50)
    for prompt, output in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        completion = output.outputs[0]
        with torch.no_grad():
            logits = hf_model(qwen3_path)(
                torch.tensor([prompt + completion.token_ids])
            ).logits
        reference = logits[0, len(prompt) - 1 : -1].float().log_softmax(dim=-1)
        assert len(completion.logprobs) == len(completion.token_ids)
        for row, token, entries in zip(
            reference, completion.token_ids, completion.logprobs
        ):
            top = row.topk(params.logprobs)
            expected = {
                token: row[token].item(),
                **dict(zip(top.indices.tolist(), top.values.tolist())),
            }
            assert list(entries) == list(expected)
            assert all(
                abs(entries[t].logprob - lp) < 1e-4 for t, lp in expected.items()
            )
            assert entries[token].rank == int((row > row[token]).sum()) + 1
            assert [entries[t].rank for t in top.indices.tolist()] == list(
                range(1, params.logprobs + 1)
            )
        assert completion.cumulative_logprob == pytest.approx(
            sum(
                entries[t].logprob
                for t, entries in zip(completion.token_ids, completion.logprobs)
            )
        )


def test_no_logprobs_unless_asked(llm):
    [output] = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3), use_tqdm=False)
    assert (
        output.outputs[0].logprobs is None
        and output.outputs[0].cumulative_logprob is None
    )


# ---- stop conditions ----


def reference_stop(
    tokenizer, tokens: list[int], stops: list[str], include: bool, min_tokens: int = 0
):
    """Plainly: the first token after which a stop string (ending past the first
    min_tokens - 1 tokens' text) is in the text; the text cut there. -> (tokens, text,
    finish_reason, stop_reason).
    """

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    unchecked = len(decode(tokens[: max(0, min_tokens - 1)]))
    for k in range(max(1, min_tokens), len(tokens) + 1):
        text = decode(tokens[:k])
        hits = sorted((text.find(s, max(0, unchecked - len(s) + 1)), s) for s in stops)
        hits = [(i, s) for i, s in hits if i >= 0]
        if hits:
            index, stop = hits[0]
            return (
                tokens[:k],
                text[: index + (len(stop) if include else 0)],
                "stop",
                stop,
            )
    return tokens, decode(tokens), "length", None


@pytest.mark.parametrize(
    "stops, include, min_tokens",
    [
        (["fch"], False, 0),  # spans the tokens 'elf' and 'che'
        (["fch"], True, 0),
        (["memory memory", "che"], False, 0),  # the earliest match wins
        ([" memory"], False, 6),  # the first ' memory' comes before min_tokens
        (["poem", "sea"], False, 0),  # only in the prompt: never a stop
    ],
)
def test_stop_strings_match_a_plain_reference(
    llm, qwen3_path, hf_model, stops, include, min_tokens
):
    prompt_ids = llm.tokenizer.encode(POEM)
    tokens = hf_continuation(hf_model, qwen3_path, prompt_ids, 30, eos_token_id=None)
    params = SamplingParams(
        temperature=0,
        max_tokens=30,
        ignore_eos=True,
        stop=stops,
        include_stop_str_in_output=include,
        min_tokens=min_tokens,
    )
    [output] = llm.generate(POEM, params, use_tqdm=False)
    completion = output.outputs[0]
    expected = reference_stop(llm.tokenizer, tokens, stops, include, min_tokens)
    assert (
        completion.token_ids,
        completion.text,
        completion.finish_reason,
        completion.stop_reason,
    ) == expected
    assert expected[2] == ("length" if "poem" in stops else "stop")


@pytest.mark.parametrize("limit", ["max_tokens", "max_model_len"])
def test_a_stop_string_completed_by_the_last_allowed_token_is_a_stop(
    llm, qwen3_path, hf_model, limit
):
    """The token that completes a stop string also reaches the length limit: the
    sequence finishes once, as "stop" with its text cut, and the request beside it is
    unharmed."""
    prompt_ids = llm.tokenizer.encode(POEM)
    tokens = hf_continuation(hf_model, qwen3_path, prompt_ids, 30, eos_token_id=None)
    k = next(k for k in range(1, 31) if "che" in llm.tokenizer.decode(tokens[:k]))
    engine = (
        llm
        if limit == "max_tokens"
        else LLM(qwen3_path, max_model_len=len(prompt_ids) + k, kvcache_block_size=16)
    )
    stopped = SamplingParams(
        temperature=0,
        max_tokens=k if limit == "max_tokens" else None,
        stop=["che"],
        ignore_eos=True,
    )
    beside = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    first, second = engine.generate(
        [POEM, [5, 6, 7]], [stopped, beside], use_tqdm=False
    )
    expected = reference_stop(llm.tokenizer, tokens[:k], ["che"], False)
    completion = first.outputs[0]
    assert (
        (
            completion.token_ids,
            completion.text,
            completion.finish_reason,
            completion.stop_reason,
        )
        == expected
        == (tokens[:k], expected[1], "stop", "che")
    )
    assert (
        second.outputs[0].finish_reason == "length"
        and len(second.outputs[0].token_ids) == 3
    )
    assert (
        engine.engine.block_manager.num_free_blocks
        == engine.engine.block_manager.num_blocks
    )


def test_eos_and_max_tokens_on_the_same_token_is_a_stop(llm):
    eos = next(iter(llm.inputs.eos_token_ids))
    llm.engine.runner, runner = ScriptedRunner(script=[5, eos]), llm.engine.runner
    try:
        [output] = llm.generate(
            [[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False
        )
    finally:
        llm.engine.runner = runner
    completion = output.outputs[0]
    assert (completion.token_ids, completion.finish_reason, completion.stop_reason) == (
        [5, eos],
        "stop",
        None,
    )


@pytest.mark.parametrize("min_tokens", [0, 5, 6])
def test_stop_token_ids_and_min_tokens_match_transformers(
    llm, qwen3_path, hf_model, min_tokens
):
    """Greedy, token 511 comes fifth; with min_tokens 5 or 6 it is the model's choice at
    the boundary itself: masked one step too few, the completion would end earlier."""
    prompt_ids = llm.tokenizer.encode(POEM)
    expected = hf_continuation(
        hf_model,
        qwen3_path,
        prompt_ids,
        30,
        eos_token_id=[511],
        min_new_tokens=min_tokens,
    )
    params = SamplingParams(
        temperature=0,
        max_tokens=30,
        ignore_eos=True,
        stop_token_ids=[511],
        min_tokens=min_tokens,
    )
    completion = llm.generate(POEM, params, use_tqdm=False)[0].outputs[0]
    assert completion.token_ids == expected and expected[-1] == 511
    assert len(expected) == (
        5 if min_tokens == 0 else min_tokens + expected[min_tokens:].index(511) + 1
    )
    if min_tokens:
        one_step_less = hf_continuation(
            hf_model,
            qwen3_path,
            prompt_ids,
            30,
            eos_token_id=[511],
            min_new_tokens=min_tokens - 1,
        )
        assert len(one_step_less) < len(expected)
    assert (completion.finish_reason, completion.stop_reason) == ("stop", 511)
    assert completion.text == added_text(llm.tokenizer, prompt_ids, expected[:-1])
    kept = llm.generate(
        POEM,
        SamplingParams(
            temperature=0,
            max_tokens=30,
            ignore_eos=True,
            stop_token_ids=[511],
            include_stop_str_in_output=True,
        ),
        use_tqdm=False,
    )[0].outputs[0]
    assert kept.text.endswith(" memory")


def test_eos_stops_with_no_stop_reason(llm):
    eos = next(iter(llm.inputs.eos_token_ids))
    outputs = llm.generate(
        random_prompts([4] * 32, seed=1),
        SamplingParams(temperature=1.0, max_tokens=300, seed=0),
        use_tqdm=False,
    )
    stopped = [
        (o.prompt_token_ids, o.outputs[0])
        for o in outputs
        if o.outputs[0].finish_reason == "stop"
    ]
    assert stopped and all(
        c.token_ids[-1] == eos and c.stop_reason is None for _, c in stopped
    )
    assert all(
        c.text == added_text(llm.tokenizer, p, c.token_ids[:-1]) for p, c in stopped
    )


# ---- n samples of one prompt ----


@pytest.mark.parametrize("salt", [None, "a tenant's"])
def test_n_samples_share_the_prompt_full_blocks_and_compute_them_once(qwen3_path, salt):
    llm = LLM(qwen3_path, max_model_len=512, kvcache_block_size=16)
    prompt = random_prompts([100], seed=51)[0]  # 6 full blocks and 4 tokens
    if salt is not None:  # each sample under the request's salt
        prompt = {"prompt_token_ids": prompt, "cache_salt": salt}
    params = SamplingParams(
        n=8, temperature=1.0, max_tokens=20, ignore_eos=True, seed=7
    )
    prefill_tokens, launch = [0], llm.engine.runner.launch

    def counting_launch(step, pending=None):
        prefill_tokens[0] += step.num_scheduled_tokens if step.ragged else 0
        return launch(step, pending)

    llm.engine.runner.launch = counting_launch
    llm.add_request(prompt, params)
    peak, outputs = 0, []
    while not llm.is_finished():
        outputs += llm.step()
        pool = llm.engine.block_manager
        peak = max(peak, pool.num_blocks - pool.num_free_blocks)
    # the first sample computes the prompt; the 7 others, its last 4 tokens (the prefix
    # cache serves them the 6 full blocks, entered in the same step)
    assert prefill_tokens[0] == 100 + 7 * 4
    # 6 shared prompt blocks; each sample: its own partial block, and one more block
    assert peak == 6 + 8 * 2  # unshared: 8 * 8
    completions = [c.token_ids for c in outputs[-1].outputs]
    assert [c.index for c in outputs[-1].outputs] == list(range(8))
    assert len(set(map(tuple, completions))) == 8 and all(
        len(c) == 20 for c in completions
    )
    again = llm.generate([prompt], params, use_tqdm=False)[0]
    # reproducible with a seed
    assert [c.token_ids for c in again.outputs] == completions
    assert (
        llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    )


def test_a_cache_salt_shares_cached_blocks_only_with_its_own_salt(
    qwen3_path, hf_greedy
):
    """vLLM's `cache_salt`: prompts share cached blocks only under the same salt (or
    none); the tokens are the same whatever the salt."""
    llm = LLM(qwen3_path, max_model_len=128, kvcache_block_size=16)
    prompt = random_prompts([40], seed=31)[0]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    cached = []
    for salt in (None, None, "alice", "alice", "bob", None):
        extra = {} if salt is None else {"cache_salt": salt}
        [output] = llm.generate({"prompt_token_ids": prompt, **extra}, greedy)
        assert output.outputs[0].token_ids == hf_greedy(qwen3_path, [prompt], 6)[0]
        cached.append(output.num_cached_tokens)
    assert cached == [0, 32, 0, 32, 0, 32]
    for bad in ("", 7):
        with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
            llm.generate({"prompt": "hi", "cache_salt": bad}, greedy)


def test_greedy_samples_equal_transformers_even_under_preemption(qwen3_path, hf_greedy):
    prompts = random_prompts([100, 37], seed=52)
    expected = hf_greedy(qwen3_path, prompts, 40)
    # 12 blocks cannot hold 4 samples of 140 tokens that share 6 blocks, and another
    # request
    llm = LLM(
        qwen3_path, max_model_len=512, kvcache_block_size=16, num_kvcache_blocks=12
    )
    outputs = llm.generate(
        prompts,
        [
            SamplingParams(n=4, temperature=0, max_tokens=40),
            SamplingParams(temperature=0, max_tokens=40),
        ],
        use_tqdm=False,
    )
    assert llm.engine.scheduler.num_preemptions > 0
    assert [c.token_ids for c in outputs[0].outputs] == [expected[0]] * 4
    assert outputs[1].outputs[0].token_ids == expected[1]
    assert llm.engine.block_manager.num_free_blocks == 12


# ---- streamed outputs ----


def test_streamed_text_grows_by_whole_characters_to_the_final_text(llm):
    prompts = random_prompts([5, 12, 30, 9, 16, 22], seed=53) + [
        "Paged attention 你好 🙂"
    ]
    params = [
        SamplingParams(
            temperature=1.0,
            max_tokens=60,
            seed=s,
            ignore_eos=s % 2 == 0,
            n=2 if s == 3 else 1,
            stop=["ti", "ck"] if s in (1, 4) else None,
            include_stop_str_in_output=s == 4,
        )
        for s in range(len(prompts))
    ]
    texts, deltas = {}, {}
    for prompt, sp in zip(prompts, params):
        llm.add_request(prompt, sp)
    finals = {}
    while not llm.is_finished():
        for output in llm.step():
            for completion in output.outputs:
                key = (output.request_id, completion.index)
                old = texts.get(key, "")
                assert completion.text.startswith(old)
                deltas.setdefault(key, []).append(completion.text[len(old) :])
                texts[key] = completion.text
                if output.finished:
                    finals[key] = (output.prompt_token_ids, completion)
    assert len(finals) == len(prompts) + 1
    split_characters = 0
    for key, (prompt_ids, completion) in finals.items():
        assert "".join(deltas[key]) == completion.text
        if "\ufffd" not in completion.text:
            assert not any("\ufffd" in delta for delta in deltas[key])
        if completion.finish_reason == "length" and completion.stop_reason is None:
            assert completion.text == added_text(
                llm.tokenizer, prompt_ids, completion.token_ids
            )
        split_characters += sum(
            len(c.encode()) > 1 and c != "\ufffd" for c in completion.text
        )
    assert split_characters > 0  # multi-byte characters did arrive over several tokens
    assert any(c.stop_reason in ("ti", "ck") for _, c in finals.values())


def test_held_back_text_is_the_longest_stop_string_less_one_character(llm):
    """While a stop string may still match, the text shown stops short of the decoded
    text by the length of the longest stop string less one character."""
    prompt = "Paged attention stores the key"
    params = SamplingParams(
        temperature=0, max_tokens=20, ignore_eos=True, stop=["zzzzz", "q"]
    )
    llm.add_request(prompt, params)
    prompt_ids, checked = llm.tokenizer.encode(prompt), 0
    while not llm.is_finished():
        for output in llm.step():
            completion = output.outputs[0]
            decoded = added_text(llm.tokenizer, prompt_ids, completion.token_ids)
            if not output.finished and "\ufffd" not in decoded:
                assert completion.text == decoded[: max(0, len(decoded) - 4)]
                checked += 1
    assert checked > 10 and completion.text == decoded


@pytest.mark.parametrize(
    "pattern", [["a", "b"], ["a", "</s>", "b"], ["</s>", "a", "<s>", "b"]]
)
def test_sentencepiece_text_keeps_the_space_before_a_word(metaspace_path, pattern):
    """With a Metaspace tokenizer a word's token carries its leading space: the
    completion's first word, and a word after a special token that prints nothing, keep
    it."""
    llm = LLM(metaspace_path, max_model_len=128, kvcache_block_size=16)
    vocab = llm.tokenizer.get_vocab()
    words = sorted(
        (t for t in vocab if t.startswith("\u2581") and len(t) > 3), key=vocab.get
    )
    tokens = {"a": words[0], "b": words[1], "</s>": "</s>", "<s>": "<s>"}
    script = [vocab[tokens[name]] for name in pattern]
    llm.engine.runner = ScriptedRunner(script=script)
    prompt = "Paged attention stores"
    params = SamplingParams(max_tokens=len(script), ignore_eos=True)
    [output] = llm.generate(prompt, params, use_tqdm=False)
    text = output.outputs[0].text
    assert text == " " + words[0][1:] + " " + words[1][1:]
    assert text == added_text(llm.tokenizer, output.prompt_token_ids, script)
    llm.engine.runner.script = list(script)
    assert "".join(llm.stream(prompt, params)) == text


def test_stream_yields_the_text_of_generate(llm):
    params = SamplingParams(temperature=1.0, max_tokens=40, seed=9, stop=["ck"])
    streamed = "".join(llm.stream("Paged attention", params))
    assert (
        streamed
        == llm.generate("Paged attention", params, use_tqdm=False)[0].outputs[0].text
    )


def test_abort_frees_every_block_and_leaves_the_others_alone(qwen3_path, hf_greedy):
    llm = LLM(qwen3_path, max_model_len=512, kvcache_block_size=16)
    prompts = random_prompts([40, 70, 25], seed=54)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    ids = [llm.add_request(p, params) for p in prompts]
    for _ in range(5):
        llm.step()
    free_before = llm.engine.block_manager.num_free_blocks
    held = len(llm.requests[ids[1]].seqs[0].block_table)
    llm.abort(ids[1])
    assert llm.engine.block_manager.num_free_blocks == free_before + held
    outputs = {}
    while not llm.is_finished():
        outputs.update({o.request_id: o for o in llm.step()})
    assert set(outputs) == {ids[0], ids[2]}
    assert [outputs[i].outputs[0].token_ids for i in (ids[0], ids[2])] == hf_greedy(
        qwen3_path, [prompts[0], prompts[2]], 30
    )
    assert (
        llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    )


# ---- chat and model ids ----


def test_chat_is_generate_on_the_chat_template(llm):
    conversations = [
        [{"role": "user", "content": "Introduce yourself."}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    ]
    params = SamplingParams(temperature=0, max_tokens=10)
    chats = llm.chat(conversations, params, use_tqdm=False)
    templated = [
        llm.tokenizer.apply_chat_template(
            c, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for c in conversations
    ]
    generated = llm.generate(templated, params, use_tqdm=False)
    assert [c.prompt_token_ids for c in chats] == templated
    assert [c.outputs[0].token_ids for c in chats] == [
        g.outputs[0].token_ids for g in generated
    ]
    [one] = llm.chat(conversations[0], params, use_tqdm=False)
    assert one.outputs[0].token_ids == chats[0].outputs[0].token_ids


def test_chat_without_a_template_says_so(llm, monkeypatch):
    monkeypatch.setattr(llm.tokenizer, "chat_template", None)
    with pytest.raises(ValueError, match="has no chat template"):
        llm.chat([{"role": "user", "content": "Hi"}])


def test_a_cached_hub_id_resolves_offline(qwen3_path, offline_hub, hf_greedy):
    repo = offline_hub / "models--nanopaged--tiny-qwen3"
    commit = "0" * 40
    shutil.copytree(qwen3_path, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    llm = LLM("nanopaged/tiny-qwen3", max_model_len=128)
    assert llm.config.model == str(repo / "snapshots" / commit)
    [output] = llm.generate(
        [[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False
    )
    assert output.outputs[0].token_ids == hf_greedy(qwen3_path, [[5, 6, 7]], 8)[0]


def test_an_unknown_hub_id_offline_is_a_value_error(offline_hub):
    with pytest.raises(
        ValueError,
        match="'nanopaged/no-such-model' is not a local directory"
        ".*neither in the cache",
    ):
        LLM("nanopaged/no-such-model")
