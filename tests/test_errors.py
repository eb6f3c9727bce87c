"""Bad input is a ValueError naming the problem, and the engine still works
afterwards."""

import json
import math
import re
import shutil

import numpy as np
import pytest
import torch
from conftest import random_prompts
from safetensors.torch import load_file, save_file

from nanopaged import LLM, SamplingParams

GOOD = random_prompts([6])[0]
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(qwen3_path):
    return LLM(
        qwen3_path,
        max_model_len=128,
        kvcache_block_size=16,
        num_kvcache_blocks=4,
        max_num_seqs=4,
    )


def assert_untouched_and_working(llm) -> None:
    assert (
        llm.is_finished()
        and not llm.requests
        and llm.engine.block_manager.num_free_blocks == 4
    )
    [out] = llm.generate([GOOD], GREEDY, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4


def mutated_params(**changes) -> SamplingParams:
    params = SamplingParams(temperature=0, max_tokens=4)
    for name, value in changes.items():
        setattr(params, name, value)  # as a caller may do after construction
    return params


@pytest.mark.parametrize(
    "prompts, params, message",
    [
        ([GOOD, []], GREEDY, "prompt is empty"),
        ([GOOD, ""], GREEDY, "prompt is empty"),
        (
            [GOOD, [1, 2, 512]],
            GREEDY,
            r"token id 512 is outside the vocabulary \[0, 512\)",
        ),
        ([GOOD, [1, -1]], GREEDY, "token id -1 is outside the vocabulary"),
        ([GOOD, [1, 2**70]], GREEDY, f"token id {2**70} is outside the vocabulary"),
        ([GOOD, [1, 2**63]], GREEDY, f"token id {2**63} is outside the vocabulary"),
        ([GOOD, [-1, 2**63]], GREEDY, "token id -1 is outside the vocabulary"),
        ([GOOD, {"prompt": [1, 2]}], GREEDY, r"'prompt' takes a text, got list"),
        (
            [GOOD, {"prompt_token_ids": "ab"}],
            GREEDY,
            r"'prompt_token_ids' takes a list of token ids, got str",
        ),
        (
            [GOOD, {"prompt": 5, "prompt_token_ids": [1, 2]}],
            GREEDY,
            r"'prompt' takes a text, got int",
        ),
        ([GOOD, [1, [2, 3]]], GREEDY, r"token ids must be integers, got \[2, 3\]"),
        ([GOOD, [1, [2]]], GREEDY, r"token ids must be integers, got \[2\] \(list\)"),
        ([GOOD, [1, "2"]], GREEDY, r"token ids must be integers, got '2' \(str\)"),
        ([GOOD, [1, 2.0]], GREEDY, r"token ids must be integers, got 2.0 \(float\)"),
        ([GOOD, [1, True]], GREEDY, r"token ids must be integers, got True \(bool\)"),
        (
            [GOOD, [np.int64(1), np.bool_(True)]],
            GREEDY,
            "token ids must be integers, got .*bool",
        ),
        (None, GREEDY, "prompts must be a prompt or a list of prompts, got NoneType"),
        (np.array([GOOD]), GREEDY, r"got ndarray \(pass array.tolist\(\)\)"),
        ((p for p in [GOOD]), GREEDY, "got generator"),
        (
            [GOOD, {"text": "hi"}],
            GREEDY,
            r"prompt dict takes the key 'prompt'.*got keys \['text'\]",
        ),
        (
            [GOOD, 5.5],
            GREEDY,
            "a prompt must be a string or a list of token ids, got float",
        ),
        (
            [GOOD, list(range(3, 131))],
            GREEDY,
            "prompt has 128 tokens; it must be shorter than max_model_len=128",
        ),
        ([GOOD, GOOD], [GREEDY], "2 prompts but 1 sampling params"),
        ([GOOD], "greedy", "sampling_params must be SamplingParams, got str"),
        ([GOOD], SamplingParams(max_tokens=100), "needs up to 7 KV-cache blocks"),
        (
            [GOOD],
            SamplingParams(n=5),
            "n=5 samples cannot run at once with max_num_seqs=4",
        ),
        (
            [GOOD],
            SamplingParams(stop_token_ids=[600]),
            r"token ids \[600\] \(in stop_token_ids.*outside the vocabulary",
        ),
        (
            [GOOD],
            SamplingParams(logit_bias={512: 1.0}),
            r"token ids \[512\] .* outside the vocabulary",
        ),
        (
            [GOOD],
            SamplingParams(allowed_token_ids=[3, 9999]),
            r"token ids \[9999\] .* outside",
        ),
        ([GOOD], SamplingParams(n=2, best_of=3), r"best_of=3 > n=2 is not supported"),
        (
            [GOOD],
            mutated_params(temperature=-1.0),
            r"temperature must be a number in \[0, .*\], got -1.0",
        ),
        (
            [GOOD],
            mutated_params(max_tokens=2.5),
            "max_tokens must be an integer, got 2.5",
        ),
        (
            [GOOD, "ok \ud800"],
            GREEDY,
            r"prompt is not valid Unicode: .*'\\ud800' at position 3",
        ),
        (
            [GOOD],
            mutated_params(stop=True),
            "stop must be a non-empty string or a list of them",
        ),
        (
            [GOOD],
            mutated_params(temperature=10**400),
            "temperature must be a number in",
        ),
    ],
)
def test_bad_request_is_rejected_and_engine_still_works(llm, prompts, params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(prompts, params, use_tqdm=False)
    assert_untouched_and_working(llm)


def test_bad_request_is_rejected_by_add_request_too(llm):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.add_request([1, 999], GREEDY)
    with pytest.raises(
        ValueError, match="request_id must be a string not in use, got 7"
    ):
        llm.add_request(GOOD, GREEDY, request_id=7)
    assert_untouched_and_working(llm)


def test_huge_sampling_values_that_are_valid_sample_beside_the_others(llm):
    huge = [
        SamplingParams(temperature=10**30, max_tokens=4, seed=1, ignore_eos=True),
        SamplingParams(
            temperature=1.0, top_k=10**30, max_tokens=4, seed=1, ignore_eos=True
        ),
    ]
    outputs = llm.generate([GOOD] * 3, huge + [GREEDY], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [4, 4, 4]
    assert (
        outputs[2].outputs[0].token_ids
        == llm.generate([GOOD], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    )


def test_a_chat_message_that_cannot_be_rendered_is_a_value_error(llm):
    with pytest.raises(ValueError, match="message 0's content is not valid Unicode"):
        llm.chat([{"role": "user", "content": "hi \ud800"}], GREEDY, use_tqdm=False)
    assert_untouched_and_working(llm)


def test_automatic_request_ids_never_take_a_chosen_one(llm):
    chosen = llm.add_request(GOOD, GREEDY, request_id="1")
    automatic = [llm.add_request(GOOD, GREEDY) for _ in range(2)]
    assert chosen == "1" and "1" not in automatic and len(set(automatic)) == 2
    finished = set()
    while not llm.is_finished():
        finished |= {o.request_id for o in llm.step() if o.finished}
    assert finished == {chosen, *automatic}


def test_samples_of_requests_admitted_together_never_exceed_max_num_seqs(llm):
    prompts = random_prompts([3, 5, 4], seed=12)
    for prompt, n in zip(prompts, (2, 3, 1)):
        llm.add_request(prompt, SamplingParams(n=n, max_tokens=2, ignore_eos=True))
    running = []
    while not llm.is_finished():
        llm.step()
        running.append(len(llm.engine.scheduler.running))
    # max_num_seqs is 4: the first four samples run, the last two wait for them to
    # finish
    assert running == [4, 0, 2, 0]


def test_numpy_token_ids_are_token_ids(llm):
    as_numpy = llm.generate([[np.int64(t) for t in GOOD]], GREEDY, use_tqdm=False)
    as_ints = llm.generate([GOOD], GREEDY, use_tqdm=False)
    assert as_numpy[0].outputs[0].token_ids == as_ints[0].outputs[0].token_ids
    assert as_numpy[0].prompt_token_ids == GOOD


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(temperature=-1),
            r"temperature must be a number in \[0, 3.40282e\+38\], got -1",
        ),
        (dict(temperature=math.nan), "temperature must be a number in .*, got nan"),
        (dict(temperature=math.inf), "temperature must be a number in .*, got inf"),
        (dict(temperature="hot"), "temperature must be a number in .*, got 'hot'"),
        (dict(top_k=-2), "top_k must be >= -1, got -2"),
        (dict(top_k=2.5), "top_k must be an integer, got 2.5"),
        (dict(top_k=True), "top_k must be an integer, got True"),
        (dict(top_p=0.0), r"top_p must be a number in \(0, 1\], got 0.0"),
        (dict(top_p=1.5), r"top_p must be a number in \(0, 1\], got 1.5"),
        (dict(top_p=math.nan), r"top_p must be a number in \(0, 1\], got nan"),
        (dict(max_tokens=0), "max_tokens must be >= 1, got 0"),
        (dict(max_tokens=math.nan), "max_tokens must be an integer, got nan"),
        (dict(max_tokens="10"), "max_tokens must be an integer, got '10'"),
        (
            dict(seed=2**64),
            r"seed must be in \[-9223372036854775808, 18446744073709551615\]",
        ),
        (dict(seed=1.5), "seed must be an integer, got 1.5"),
        (dict(n=0), "n must be >= 1, got 0"),
        (dict(n=2.0), "n must be an integer, got 2.0"),
        (dict(min_tokens=-1), "min_tokens must be >= 0, got -1"),
        (dict(min_tokens=8, max_tokens=4), "max_tokens=4 is less than min_tokens=8"),
        (dict(stop=""), "stop must be a non-empty string or a list of them, got ''"),
        (
            dict(stop=["ok", 3]),
            r"stop must be a non-empty string or a list of them, got \['ok', 3\]",
        ),
        (dict(stop_token_ids=5), "stop_token_ids must be a list of token ids, got 5"),
        (dict(stop_token_ids=[-1]), "stop_token_ids must be >= 0, got -1"),
        (dict(stop_token_ids=[1.5]), "stop_token_ids must be an integer, got 1.5"),
        (dict(logprobs=-1), r"logprobs must be in \[0, 20\], got -1"),
        (dict(logprobs=21), r"logprobs must be in \[0, 20\], got 21"),
        (dict(ignore_eos="yes"), "ignore_eos must be True or False, got 'yes'"),
        (
            dict(include_stop_str_in_output=1),
            "include_stop_str_in_output must be True or False",
        ),
        (
            dict(stop=True),
            "stop must be a non-empty string or a list of them, got True",
        ),
        (dict(stop=5), "stop must be a non-empty string or a list of them, got 5"),
        (dict(temperature=10**39), "temperature must be a number in"),
        (
            dict(presence_penalty=2.5),
            r"presence_penalty must be a number in \[-2, 2\], got 2.5",
        ),
        (
            dict(frequency_penalty=-3),
            r"frequency_penalty must be a number in \[-2, 2\]",
        ),
        (dict(repetition_penalty=0), r"repetition_penalty must be a number in \(0, "),
        (dict(min_p=1.5), r"min_p must be a number in \[0, 1\], got 1.5"),
        (dict(logit_bias=[1, 2]), "logit_bias must map token ids to numbers"),
        (
            dict(logit_bias={"7": 1.0}),
            "logit_bias token id must be an integer, got '7'",
        ),
        (
            dict(logit_bias={7: "up"}),
            "logit_bias for token 7 must be a number, got 'up'",
        ),
        (dict(allowed_token_ids=[]), "allowed_token_ids must not be empty"),
        (
            dict(allowed_token_ids=[1.5]),
            "allowed_token_ids must be an integer, got 1.5",
        ),
        (dict(bad_words="x"), "bad_words must be a non-empty string or a list of them"),
        (dict(bad_words=[""]), "bad_words must be"),
        (dict(prompt_logprobs=21), r"prompt_logprobs must be in \[0, 20\], got 21"),
        (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens must be >= 1, got 0"),
        (dict(best_of=1, n=2), "best_of=1 must be >= n=2"),
        (dict(detokenize=0), "detokenize must be True or False, got 0"),
        (dict(stop=["x"], detokenize=False), "stop strings need the text"),
    ],
)
def test_invalid_sampling_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_num_seqs=0), "max_num_seqs must be >= 1, got 0"),
        (dict(max_num_seqs=1.5), "max_num_seqs must be int, got 1.5"),
        (dict(max_num_batched_tokens=0), "max_num_batched_tokens must be >= 1"),
        (dict(max_model_len=0), "max_model_len must be >= 1"),
        (dict(kvcache_block_size=0), "kvcache_block_size must be >= 1"),
        (
            dict(kvcache_block_size=16.0),
            "kvcache_block_size must be int or None, got 16.0",
        ),
        (dict(enforce_eager="yes"), "enforce_eager must be bool, got 'yes'"),
        (dict(tensor_parallel_size=True), "tensor_parallel_size must be int, got True"),
        (
            dict(gpu_memory_utilization=1.5),
            r"gpu_memory_utilization must be in \(0, 1\]",
        ),
        (
            dict(gpu_memory_utilization="0.5"),
            "gpu_memory_utilization must be a number, got '0.5'",
        ),
        (dict(num_kvcache_blocks=0), "num_kvcache_blocks must be >= 1"),
        (dict(attention_backend="magic"), "attention_backend must be one of"),
        (dict(attention_backend="flash", device="cpu"), "needs a CUDA GPU"),
        (dict(scheduling="fastest"), "scheduling must be one of"),
        (
            dict(dtype="int8"),
            r"dtype must be one of \('auto', 'half', .*'float32'\), got 'int8'",
        ),
        (dict(swap_space="4"), "swap_space must be a number, got '4'"),
        (dict(trust_remote_code=1), "trust_remote_code must be bool, got 1"),
        (
            dict(block_size=16, kvcache_block_size=32),
            "block_size=16 and kvcache_block_size=32 disagree",
        ),
        (
            dict(
                enable_chunked_prefill=False,
                max_num_batched_tokens=100,
                max_model_len=128,
            ),
            "max_num_batched_tokens=100 is smaller than max_model_len=128: without "
            "chunked prefill",
        ),
        (
            dict(generation_config="/nowhere"),
            "generation_config='/nowhere' has no generation_config.json",
        ),
        (dict(device="tpu"), r"device must be one of \(.cuda., .cpu.\), got .tpu."),
        (
            dict(max_num_seq=8),
            "unknown option 'max_num_seq'; did you mean 'max_num_seqs'",
        ),
        (
            dict(revision="main"),
            "unknown option 'revision'; the options are tokenizer, tokenizer_mode, "
            "device, ",
        ),
    ],
)
def test_invalid_option_names_the_option(qwen3_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(qwen3_path, **kwargs)


def broken_copy(path, tmp_path, config_changes: dict | None = None, **edit) -> str:
    """A copy of the checkpoint with config fields changed or files edited."""
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    if config_changes:
        config = json.loads((broken / "config.json").read_text())
        config.update(config_changes)
        (broken / "config.json").write_text(json.dumps(config))
    for name, text in edit.items():
        target = broken / name.replace("__", ".")
        target.unlink() if text is None else target.write_text(text)
    return str(broken)


@pytest.mark.parametrize("path", ["/nonexistent", "./not/here", "~/nowhere-at-all"])
def test_a_path_that_is_no_directory_is_said_so_not_looked_up_on_the_hub(path):
    with pytest.raises(
        ValueError, match=f"model '{re.escape(path)}': no such directory$"
    ):
        LLM(path)


def test_missing_model_names_it_and_says_how_to_get_it(offline_hub):
    with pytest.raises(
        ValueError,
        match=r"'nowhere/model' is not a local directory.*hf download nowhere/model"
        r".*nanopaged.random_checkpoint DIR",
    ):
        LLM("nowhere/model")


@pytest.mark.parametrize(
    "config_changes, edit, message",
    [
        (None, dict(config__json=None), "has no config.json"),
        (None, dict(config__json="{not json"), "cannot read .*config.json"),
        (
            {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"},
            {},
            r"unsupported architecture \['GPT2LMHeadModel'\].*Qwen3ForCausalLM",
        ),
        (
            {"hidden_act": "gelu"},
            {},
            "hidden_act='gelu', which nanopaged does not implement",
        ),
        (
            {
                "rope_parameters": {
                    "rope_type": "yarn",
                    "factor": 2.0,
                    "rope_theta": 10000.0,
                    "original_max_position_embeddings": 1024,
                }
            },
            {},
            "rope_type='yarn'",
        ),
        (
            {"layer_types": ["full_attention", "chunked_attention"]},
            {},
            "layer_types={'chunked_",
        ),
        (
            {"quantization_config": {"quant_method": "bitsandbytes"}},
            {},
            "quant_method=.bitsandbytes",
        ),
        (
            None,
            dict(tokenizer__json=None),
            "cannot load the tokenizer .* none of tokenizer.json",
        ),
    ],
)
def test_unusable_checkpoint_names_the_field(
    qwen3_path, tmp_path, config_changes, edit, message
):
    with pytest.raises(ValueError, match=message):
        LLM(broken_copy(qwen3_path, tmp_path, config_changes, **edit))


def test_truncated_weights_are_named(qwen3_path, tmp_path):
    broken = broken_copy(qwen3_path, tmp_path)
    weights = tmp_path / "broken" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    with pytest.raises(
        ValueError, match="cannot read .*model.safetensors.*truncated download"
    ):
        LLM(broken)


@pytest.mark.parametrize(
    "name, tensor, message",
    [
        (
            "model.norm.weight",
            torch.ones(3),
            "weight 'model.norm.weight' .* does not fit the model",
        ),
        (
            "model.layers.1.self_attn.v_proj.weight",
            None,
            "missing weights.*layers.1.self_attn.qkv_proj",
        ),
        (
            "model.layers.0.mystery.weight",
            torch.zeros(2),
            "unexpected weight 'model.layers.0.mystery.weight'",
        ),
    ],
)
def test_a_weight_that_does_not_fit_is_named(
    qwen3_path, tmp_path, name, tensor, message
):
    broken = broken_copy(qwen3_path, tmp_path)
    weights = load_file(tmp_path / "broken" / "model.safetensors")
    if tensor is None:
        del weights[name]
    else:
        weights[name] = tensor
    save_file(
        weights, tmp_path / "broken" / "model.safetensors", metadata={"format": "pt"}
    )
    with pytest.raises(ValueError, match=message):
        LLM(broken)


def test_text_prompt_is_checked_against_the_model_vocabulary(qwen3_path, tmp_path):
    """A tokenizer larger than the model's embedding: its ids are caught before any
    step."""
    small = broken_copy(qwen3_path, tmp_path, {"vocab_size": 256})
    weights = load_file(tmp_path / "broken" / "model.safetensors")
    weights["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"][
        :256
    ].clone()
    save_file(
        weights, tmp_path / "broken" / "model.safetensors", metadata={"format": "pt"}
    )
    llm = LLM(small, max_model_len=128)
    with pytest.raises(
        ValueError,
        match=r"outside the vocabulary \[0, 256\): the tokenizer does not match",
    ):
        llm.generate(
            ["Paged attention stores the key and value cache"], GREEDY, use_tqdm=False
        )
    pool = llm.engine.block_manager
    assert llm.is_finished() and pool.num_free_blocks == pool.num_blocks


def test_a_closed_engine_says_so(qwen3_path):
    llm = LLM(qwen3_path, max_model_len=128)
    llm.close()
    for call in (
        lambda: llm.generate([GOOD], GREEDY),
        lambda: llm.step(),
        lambda: llm.add_request(GOOD, GREEDY),
    ):
        with pytest.raises(RuntimeError, match="the engine is closed"):
            call()


def test_a_max_model_len_beyond_the_models_positions_is_refused(
    qwen3_path, monkeypatch
):
    """As vLLM: the model's 2,048 positions are the most, unless
    VLLM_ALLOW_LONG_MAX_MODEL_LEN says to stretch them (read, never set)."""
    with pytest.raises(ValueError, match="max_model_len=100000 is more than the"):
        LLM(qwen3_path, max_model_len=100000)
    assert LLM(qwen3_path, max_model_len=2048).config.max_model_len == 2048
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    llm = LLM(qwen3_path, max_model_len=3000, num_kvcache_blocks=200)
    assert llm.config.max_model_len == 3000
    prompt = random_prompts([2990])[0]
    [out] = llm.generate([prompt], GREEDY, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4  # positions past 2,048 run
