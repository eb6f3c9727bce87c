"""vLLM's offline API as vLLM's own examples use it (basic, llm_engine_example, chat,
generate, automatic prefix caching, reproducibility, profiling), written as tests of the
same calls with only the import changed, plus the options and methods those scripts pass
and call."""

import dataclasses
import json
import os
import shutil

import pytest
from conftest import random_prompts

from nanopaged import LLM, EngineArgs, LLMEngine, RequestOutput, SamplingParams
from nanopaged.inputs import TextPrompt, TokensPrompt
from nanopaged.utils import FlexibleArgumentParser

PROMPTS = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]


def test_basic_example(qwen3_path):
    sampling_params = SamplingParams(temperature=0.8, top_p=0.95)
    llm = LLM(model=qwen3_path)
    outputs = llm.generate(PROMPTS, sampling_params)
    assert [output.prompt for output in outputs] == PROMPTS
    assert all(
        len(o.outputs[0].token_ids) <= 16 and isinstance(o.outputs[0].text, str)
        for o in outputs
    )


def test_llm_engine_example(qwen3_path):
    """Requests added one a step, in vLLM's argument order, until none is unfinished."""
    parser = EngineArgs.add_cli_args(
        FlexibleArgumentParser(description="LLMEngine directly")
    )
    args = parser.parse_args(["--model", qwen3_path, "--max_model_len", "256"])
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    assert engine.config.max_model_len == 256
    test_prompts = [
        (
            "A robot may not injure a human being",
            SamplingParams(temperature=0.0, logprobs=1, prompt_logprobs=1),
        ),
        (
            "To be or not to be,",
            SamplingParams(temperature=0.8, top_k=5, presence_penalty=0.2),
        ),
        (
            "What is the meaning of life?",
            SamplingParams(
                n=2, best_of=2, temperature=0.8, top_p=0.95, frequency_penalty=0.1
            ),
        ),
    ]
    request_id, finished = 0, {}
    while test_prompts or engine.has_unfinished_requests():
        if test_prompts:
            prompt, sampling_params = test_prompts.pop(0)
            engine.add_request(str(request_id), prompt, sampling_params)
            request_id += 1
        request_outputs: list[RequestOutput] = engine.step()
        finished.update({o.request_id: o for o in request_outputs if o.finished})
    assert sorted(finished) == ["0", "1", "2"] and len(finished["2"].outputs) == 2
    first = finished["0"]
    assert len(first.prompt_logprobs) == len(first.prompt_token_ids)
    assert len(first.outputs[0].logprobs) == len(first.outputs[0].token_ids)


def test_chat_example(qwen3_path):
    """`LLM(**vars(args))` from EngineArgs' flags; one conversation, ten, and a
    template."""
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    parser.set_defaults(model=qwen3_path)
    parser.add_argument("--chat-template-path", type=str, default=None)
    args = parser.parse_args(["--max-model-len", "512"])
    del args.chat_template_path
    llm = LLM(**vars(args))
    sampling_params = SamplingParams(max_tokens=8, temperature=0)
    conversation = [
        {"role": "system", "content": "You are a helpful assistant"},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hello! How can I assist you today?"},
        {
            "role": "user",
            "content": "Write an essay about the importance of higher education.",
        },
    ]
    [one] = llm.chat(conversation, sampling_params, use_tqdm=False)
    assert one.prompt == llm.tokenizer.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=True
    )
    ten = llm.chat([conversation] * 10, sampling_params, use_tqdm=True)
    assert [o.outputs[0].token_ids for o in ten] == [one.outputs[0].token_ids] * 10
    template = (
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    )
    [custom] = llm.chat(
        conversation, sampling_params, use_tqdm=False, chat_template=template
    )
    assert custom.prompt.startswith("[system] You are a helpful assistant\n")


def test_engine_args_as_a_dict(qwen3_path):
    engine_args = EngineArgs(model=qwen3_path, max_model_len=128, seed=3, block_size=16)
    llm = LLM(**dataclasses.asdict(engine_args))
    assert (
        llm.config.max_model_len,
        llm.config.seed,
        llm.config.kvcache_block_size,
    ) == (128, 3, 16)


def test_automatic_prefix_caching_example(qwen3_path):
    long_prefix = " ".join(["Paged attention stores the cache in blocks."] * 12)
    llm = LLM(model=qwen3_path, enable_prefix_caching=True, max_model_len=512)
    params = SamplingParams(temperature=0, max_tokens=8)
    first = llm.generate(long_prefix + " Question one?", params, use_tqdm=False)[0]
    second = llm.generate(long_prefix + " Question two?", params, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens >= 64
    off = LLM(model=qwen3_path, enable_prefix_caching=False, max_model_len=512)
    off.generate(long_prefix + " Question one?", params, use_tqdm=False)
    again = off.generate(long_prefix + " Question two?", params, use_tqdm=False)[0]
    assert (
        again.num_cached_tokens == 0
        and again.outputs[0].token_ids == second.outputs[0].token_ids
    )


def test_reproducibility_example(qwen3_path):
    """vLLM's default engine seed: unseeded samples repeat from one run to the next."""
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=12)

    def run(**options):
        return [
            o.outputs[0].token_ids
            for o in LLM(qwen3_path, max_model_len=128, **options).generate(
                PROMPTS, params, use_tqdm=False
            )
        ]

    assert run() == run() == run(seed=0)
    assert run(seed=42) == run(seed=42) != run()


def test_profiling_example(qwen3_path, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path / "traces"))
    llm = LLM(model=qwen3_path, max_model_len=128)
    llm.start_profile()
    llm.generate(PROMPTS, SamplingParams(max_tokens=4), use_tqdm=False)
    trace = llm.stop_profile()
    assert os.path.dirname(trace) == str(tmp_path / "traces")
    assert any(
        "aten::" in event.get("name", "")
        for event in json.load(open(trace))["traceEvents"]
    )
    monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR")
    with pytest.raises(ValueError, match="VLLM_TORCH_PROFILER_DIR"):
        llm.start_profile()


def test_prompt_types_from_vllms_module_path(qwen3_path):
    llm = LLM(qwen3_path, max_model_len=128)
    ids = llm.tokenizer.encode(PROMPTS[0])
    params = SamplingParams(temperature=0, max_tokens=6)
    by_text = llm.generate(TextPrompt(prompt=PROMPTS[0]), params, use_tqdm=False)[0]
    by_ids = llm.generate(TokensPrompt(prompt_token_ids=ids), params, use_tqdm=False)[0]
    assert (
        by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids
        and by_ids.prompt is None
    )


def test_engine_methods_vllm_scripts_call(qwen3_path):
    llm = LLM(qwen3_path, max_model_len=128)
    assert llm.get_tokenizer() is llm.tokenizer
    ids = [
        llm.add_request(str(i), p, SamplingParams(max_tokens=4))
        for i, p in enumerate(PROMPTS)
    ]
    assert llm.has_unfinished_requests()
    llm.abort_request(ids[:2])
    llm.abort_request(ids[2])
    llm.step()
    # a request holds blocks
    assert len(llm.requests) == 1 and not llm.reset_prefix_cache()
    while llm.has_unfinished_requests():
        llm.step()
    assert llm.reset_prefix_cache()
    cached = llm.generate(PROMPTS[1] * 3, SamplingParams(max_tokens=2), use_tqdm=False)[
        0
    ]
    again = llm.generate(PROMPTS[1] * 3, SamplingParams(max_tokens=2), use_tqdm=False)[
        0
    ]
    assert cached.num_cached_tokens == 0 < again.num_cached_tokens
    assert llm.reset_prefix_cache()
    assert (
        llm.generate(PROMPTS[1] * 3, SamplingParams(max_tokens=2), use_tqdm=False)[
            0
        ].num_cached_tokens
        == 0
    )


def test_default_sampling_params_come_from_the_generation_config(qwen3_path, tmp_path):
    path = shutil.copytree(qwen3_path, tmp_path / "model")
    config = json.loads((path / "generation_config.json").read_text())
    config.update(temperature=0.0, top_k=20, repetition_penalty=1.2, max_new_tokens=5)
    (path / "generation_config.json").write_text(json.dumps(config))
    llm = LLM(str(path), max_model_len=128)
    defaults = llm.get_default_sampling_params()
    assert (
        defaults.temperature,
        defaults.top_k,
        defaults.repetition_penalty,
        defaults.max_tokens,
    ) == (0.0, 20, 1.2, 5)
    [output] = llm.generate(PROMPTS[:1], use_tqdm=False)
    assert (
        output.outputs[0].token_ids
        == llm.generate(PROMPTS[:1], defaults, use_tqdm=False)[0].outputs[0].token_ids
        and len(output.outputs[0].token_ids) <= 5
    )
    plain = LLM(str(path), max_model_len=128, generation_config="vllm")
    assert plain.get_default_sampling_params() == SamplingParams()


def test_max_model_len_defaults_to_the_models(qwen3_path, tmp_path):
    path = shutil.copytree(qwen3_path, tmp_path / "long")
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 8192
    (path / "config.json").write_text(json.dumps(config))
    llm = LLM(str(path), num_kvcache_blocks=300, max_num_seqs=2)
    assert llm.config.max_model_len == 8192
    [output] = llm.generate(
        [random_prompts([4097], seed=3)[0]],
        SamplingParams(max_tokens=2, ignore_eos=True),
        use_tqdm=False,
    )
    assert len(output.outputs[0].token_ids) == 2


@pytest.mark.parametrize(
    "options",
    [
        dict(trust_remote_code=True, disable_log_stats=False, swap_space=0),
        dict(dtype="auto"),
        dict(dtype="float"),
        dict(enable_chunked_prefill=False),
        dict(tokenizer="SAME"),
        dict(block_size=16),
        dict(scheduling_policy="fcfs"),
    ],
)
def test_options_vllm_scripts_pass_are_taken(qwen3_path, hf_greedy, options):
    options = {k: qwen3_path if v == "SAME" else v for k, v in options.items()}
    llm = LLM(qwen3_path, max_model_len=128, max_num_batched_tokens=128, **options)
    prompts = random_prompts([5, 30], seed=74)
    outputs = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(
        qwen3_path, prompts, 8
    )


def test_priority_is_first_come_first_served_as_vllms_default_policy(qwen3_path):
    """vLLM's fcfs policy takes priority 0 and refuses any other, and nanopaged has no
    other policy."""
    with pytest.raises(ValueError, match="scheduling_policy='priority' is not"):
        LLM(qwen3_path, scheduling_policy="priority")
    llm = LLM(qwen3_path, max_model_len=128)
    params = SamplingParams(max_tokens=2)
    assert len(llm.generate(PROMPTS[:2], params, priority=[0, 0])) == 2
    with pytest.raises(ValueError, match="priority 1 needs priority scheduling"):
        llm.generate(PROMPTS[:2], params, priority=[0, 1])
    with pytest.raises(ValueError, match="priority -3 needs priority scheduling"):
        llm.add_request(PROMPTS[0], params, priority=-3)
    assert not llm.requests
    llm.add_request(PROMPTS[0], params, priority=0)
    while llm.has_unfinished_requests():
        llm.step()


def test_without_chunked_prefill_a_prompt_runs_whole(qwen3_path):
    llm = LLM(
        qwen3_path,
        max_model_len=64,
        max_num_batched_tokens=64,
        enable_chunked_prefill=False,
    )
    steps, launch = [], llm.engine.runner.launch
    llm.engine.runner.launch = lambda step, pending=None: (
        steps.append(list(step.num_tokens)) or launch(step, pending)
    )
    llm.generate(
        random_prompts([40, 40], seed=75), SamplingParams(max_tokens=1), use_tqdm=False
    )
    # the second waits rather than run in part beside the first
    assert steps == [[40], [40]]


def test_truncate_prompt_tokens_keeps_the_last_tokens(qwen3_path, hf_greedy):
    llm = LLM(qwen3_path, max_model_len=128)
    prompt = random_prompts([50], seed=76)[0]
    params = SamplingParams(temperature=0, max_tokens=8, truncate_prompt_tokens=20)
    [output] = llm.generate([prompt], params, use_tqdm=False)
    assert output.prompt_token_ids == prompt[-20:]
    assert output.outputs[0].token_ids == hf_greedy(qwen3_path, [prompt[-20:]], 8)[0]


def test_detokenize_false_gives_tokens_without_text(qwen3_path):
    llm = LLM(qwen3_path, max_model_len=128)
    params = SamplingParams(temperature=0, max_tokens=6, detokenize=False, logprobs=1)
    [output] = llm.generate(PROMPTS[:1], params, use_tqdm=False)
    completion = output.outputs[0]
    assert completion.text == "" and len(completion.token_ids) == 6
    assert all(
        entry.decoded_token is None
        for lp in completion.logprobs
        for entry in lp.values()
    )


# ---- chat as vLLM renders it ----

TOOLS_TEMPLATE = (
    "{% if tools %}tools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}"
    "\n{% endif %}"
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] or '' }}"
    "{% for c in m.get('tool_calls') or [] %}call {{ c['function']['name'] }}"
    "({{ c['function']['arguments']['city'] }}){% endfor %}"
    "</{{ m['role'] }}>\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% if think %}<think>{% endif %}"
    "{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def test_chat_renders_tools_tool_calls_and_template_options(qwen3_path):
    llm = LLM(qwen3_path, max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=4)
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Weather"},
                {"type": "text", "text": "in Paris?"},
            ],
        },
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_0",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris"}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_0", "content": "sunny"},
    ]
    [output] = llm.chat(
        messages,
        params,
        use_tqdm=False,
        chat_template=TOOLS_TEMPLATE,
        tools=[WEATHER],
        chat_template_kwargs={"think": True},
    )
    assert output.prompt == (
        "tools: get_weather<user>Weather\nin Paris?</user>\n"
        "<assistant>call get_weather(Paris)</assistant>\n"
        "<tool>sunny</tool>\n<assistant><think>"
    )
    assert output.prompt_token_ids == llm.tokenizer.encode(
        output.prompt, add_special_tokens=False
    )
    [continued] = llm.chat(
        messages[:1] + [{"role": "assistant", "content": "It is"}],
        params,
        use_tqdm=False,
        add_generation_prompt=False,
        continue_final_message=True,
    )
    assert continued.prompt.endswith("<|im_start|>assistant\nIt is")


@pytest.mark.parametrize(
    "messages, options, message",
    [
        (
            [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "x"}}],
                }
            ],
            {},
            "content part of type 'image_url'; this model takes only text parts",
        ),
        (
            [{"role": "user", "content": "hi"}],
            dict(continue_final_message=True),
            "cannot go with add_generation_prompt=True",
        ),
        ([{"role": "user"}], {}, "message 0 has no content"),
        ([{"content": "hi"}], {}, "message 0 must be an object with a string role"),
        (
            [{"role": "user", "content": "hi"}],
            dict(chat_template_content_format="openai"),
            "chat_template_content_format='openai' is not supported",
        ),
    ],
)
def test_a_conversation_that_cannot_be_rendered_is_a_value_error(
    qwen3_path, messages, options, message
):
    llm = LLM(qwen3_path, max_model_len=128)
    with pytest.raises(ValueError, match=message):
        llm.chat(messages, SamplingParams(max_tokens=2), use_tqdm=False, **options)
    assert llm.is_finished() and not llm.requests


def test_vllms_module_paths(qwen3_path):
    """The paths vLLM's scripts import from, beyond `vllm`: the same names and meanings,
    or an ImportError that says what to use instead."""
    import nanopaged.envs as envs
    from nanopaged.distributed import cleanup_dist_env_and_memory
    from nanopaged.engine.arg_utils import EngineArgs as EngineArgsThere
    from nanopaged.engine.llm_engine import LLMEngine as LLMEngineThere
    from nanopaged.entrypoints.llm import LLM as LLMThere

    assert (EngineArgsThere, LLMEngineThere, LLMThere) == (EngineArgs, LLMEngine, LLM)
    assert callable(cleanup_dist_env_and_memory) and envs.VLLM_USE_V1 is True
    with pytest.raises(ImportError, match="start_profile"):
        from nanopaged.profiler import layerwise_profile  # noqa: F401
    with pytest.raises(ImportError, match="cannot import 'LoRA.*nanopaged.engine"):
        from nanopaged.engine.arg_utils import LoRAConfig  # noqa: F401
    with pytest.raises(AttributeError, match="nanopaged.envs has no 'VLLM_NO_SUCH'"):
        _ = envs.VLLM_NO_SUCH
    with pytest.raises(ValueError, match="tokenizer_mode='slow' is not supported"):
        LLM(qwen3_path, tokenizer_mode="slow")


def test_cleanup_between_two_tensor_parallel_engines(qwen3_path, hf_greedy):
    """As vLLM's tests do: an engine, `del`, cleanup_dist_env_and_memory(), another
    engine."""
    from nanopaged.distributed import cleanup_dist_env_and_memory

    want = hf_greedy(qwen3_path, [[5, 6, 7]], 6)
    for _ in range(2):
        llm = LLM(qwen3_path, max_model_len=256, tensor_parallel_size=2)
        outputs = llm.generate(
            [[5, 6, 7]],
            SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
            use_tqdm=False,
        )
        assert [o.outputs[0].token_ids for o in outputs] == want
        del llm
        cleanup_dist_env_and_memory()
