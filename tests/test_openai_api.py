"""Every request field the server takes does what OpenAI and vLLM say, or is refused by
name; the endpoints clients probe (/tokenize, /detokenize, /version, /v1/models/{id})
answer as vLLM's; the command line and a shutdown mid-stream behave as a newcomer
expects."""

import json
import os
import signal
import socket
import subprocess
import sys

import httpx
import pytest
from test_server import OPTIONS, ROOT, Server

from nanopaged import LLM, SamplingParams

openai = pytest.importorskip("openai")
PROMPT = "Paged attention stores the key and value cache"


@pytest.fixture(scope="module")
def server(qwen3_path):
    server = Server(qwen3_path, *OPTIONS, "--max-num-batched-tokens", "64")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def llm(qwen3_path):
    return LLM(qwen3_path, max_model_len=512, kvcache_block_size=16)


def post(server, path: str, **body) -> httpx.Response:
    return httpx.post(server.url + path, json=dict(model="tiny", **body), timeout=60)


def test_echo_with_logprobs_is_the_prompts_logprobs_then_the_completions(server, llm):
    """What lm-eval's loglikelihood asks: the prompt's tokens scored, with max_tokens 1
    or 0."""
    ids = llm.tokenizer.encode(PROMPT)
    [offline] = llm.generate(
        [ids],
        SamplingParams(temperature=0, max_tokens=1, logprobs=1, prompt_logprobs=1),
        use_tqdm=False,
    )
    for max_tokens in (1, 0):
        choice = post(
            server,
            "/v1/completions",
            prompt=PROMPT,
            max_tokens=max_tokens,
            temperature=0,
            logprobs=1,
            echo=True,
        ).json()["choices"][0]
        generated = offline.outputs[0].token_ids[:max_tokens]
        assert (
            choice["text"]
            == PROMPT + offline.outputs[0].text[: len(choice["text"]) - len(PROMPT)]
        )
        logprobs = choice["logprobs"]
        tokens = ids + generated
        assert logprobs["tokens"] == [llm.tokenizer.decode([t]) for t in tokens]
        expected = [None] + [
            e[t].logprob for t, e in zip(ids[1:], offline.prompt_logprobs[1:])
        ]
        expected += [
            e[t].logprob for t, e in zip(generated, offline.outputs[0].logprobs)
        ]
        assert (
            logprobs["token_logprobs"][0] is None
            and logprobs["top_logprobs"][0] is None
        )
        assert logprobs["token_logprobs"][1:] == pytest.approx(expected[1:], abs=1e-5)
        offsets = [
            sum(len(t) for t in logprobs["tokens"][:i]) for i in range(len(tokens))
        ]
        assert logprobs["text_offset"] == offsets
        assert choice["finish_reason"] == (
            offline.outputs[0].finish_reason if max_tokens else "length"
        )


def test_vllm_sampling_fields_are_honoured(server, llm):
    fields = dict(
        stop_token_ids=[7],
        include_stop_str_in_output=True,
        repetition_penalty=1.3,
        min_p=0.1,
        frequency_penalty=0.4,
        presence_penalty=0.2,
        top_k=40,
        skip_special_tokens=False,
        ignore_eos=True,
        min_tokens=2,
        logit_bias={"101": 5.0},
        bad_words=["memory"],
        allowed_token_ids=None,
    )
    params = dict(
        fields, logit_bias={101: 5.0}, temperature=0, max_tokens=20, prompt_logprobs=2
    )
    [offline] = llm.generate([PROMPT], SamplingParams(**params), use_tqdm=False)
    body = post(
        server,
        "/v1/completions",
        prompt=PROMPT,
        temperature=0,
        max_tokens=20,
        prompt_logprobs=2,
        **fields,
    ).json()
    assert body["choices"][0]["text"] == offline.outputs[0].text
    assert body["usage"]["completion_tokens"] == len(offline.outputs[0].token_ids)


def test_completions_return_the_prompt_logprobs_asked_for(server, llm):
    """vLLM's `prompt_logprobs` field: each choice (and the first chunk of a streamed
    one) has, per prompt token (None for the first), the logprob, rank and text of it
    and the top k."""
    ids = llm.tokenizer.encode(PROMPT)
    [offline] = llm.generate(
        [ids],
        SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2),
        use_tqdm=False,
    )
    body = dict(
        model="tiny", prompt=PROMPT, temperature=0, max_tokens=2, prompt_logprobs=2
    )
    whole = httpx.post(server.url + "/v1/completions", json=body).json()["choices"][0]
    with httpx.stream(
        "POST", server.url + "/v1/completions", json=dict(body, stream=True)
    ) as r:
        first = json.loads(next(line for line in r.iter_lines() if line)[6:])[
            "choices"
        ][0]
    for got in (whole["prompt_logprobs"], first["prompt_logprobs"]):
        assert got[0] is None and len(got) == len(ids)
        for entry, expected in zip(got[1:], offline.prompt_logprobs[1:]):
            assert set(entry) == {str(t) for t in expected}
            for token, logprob in expected.items():
                assert entry[str(token)]["logprob"] == pytest.approx(
                    logprob.logprob, abs=1e-5
                )
                assert (
                    entry[str(token)]["rank"],
                    entry[str(token)]["decoded_token"],
                ) == (logprob.rank, logprob.decoded_token)
    plain = post(server, "/v1/completions", prompt=PROMPT, max_tokens=1).json()[
        "choices"
    ][0]
    assert plain["prompt_logprobs"] is None


BAD_VALUES = ["x", -1, 1.5, [], [1, "a"], {"a": {}}, True]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_no_value_of_any_field_is_a_500(server, path):
    """Every field the server takes, given values of the wrong type or range: a 400 that
    names a field (or a 200 where the value is fine), never a 500, and the server serves
    on."""
    from concurrent.futures import ThreadPoolExecutor

    from nanopaged.serving.openai_api import CHAT_FIELDS, COMPLETION_FIELDS

    chat = path.endswith("chat/completions")
    base = (
        {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    )
    cases = [
        (field, value)
        for field in sorted(CHAT_FIELDS if chat else COMPLETION_FIELDS)
        for value in BAD_VALUES
    ]

    def send(case):  # many at once: the engine batches them
        field, value = case
        body = {"model": "tiny", **base, "max_tokens": 2, field: value}
        return case, client.post(server.url + path, json=body)

    with ThreadPoolExecutor(4) as pool, httpx.Client(timeout=120) as client:
        responses = list(pool.map(send, cases))
    for (field, value), response in responses:
        assert response.status_code in (200, 400, 404), (field, value, response.text)
        if response.status_code == 400:
            assert response.json()["error"]["message"], (field, value)
    assert (
        400 in {response.status_code for _, response in responses} and server.healthy()
    )


def test_a_cache_salt_keeps_a_tenants_blocks_its_own(server):
    """vLLM's `cache_salt` field: the same prompt under another salt is not served
    cached blocks, under the same salt it is."""
    prompt = list(range(3, 60))  # whole blocks of any size up to 57 tokens
    cached = []
    for salt in ("tenant a", "tenant a", "tenant b", "tenant b"):
        body = post(
            server, "/v1/completions", prompt=prompt, max_tokens=1, cache_salt=salt
        ).json()
        cached.append(body["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert cached[0] == cached[2] == 0 and cached[1] == cached[3] > 0


def test_openai_penalties_and_logit_bias_through_the_client(server, llm):
    [offline] = llm.generate(
        [PROMPT],
        SamplingParams(
            temperature=0,
            max_tokens=16,
            frequency_penalty=1.0,
            presence_penalty=0.5,
            logit_bias={202: 3.0},
        ),
        use_tqdm=False,
    )
    result = server.client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=16,
        temperature=0,
        frequency_penalty=1.0,
        presence_penalty=0.5,
        logit_bias={"202": 3.0},
    )
    assert result.choices[0].text == offline.outputs[0].text


def test_content_parts_and_tool_messages_reach_the_template(server, llm):
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c0",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c0", "content": "sunny"},
    ]
    template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] or '' }}"
        "{% for c in m.get('tool_calls') or [] %}"
        "{{ c['function']['arguments']['city'] }}{% endfor %}"
        "{% if tools %} [{{ tools | length }} tools]{% endif %}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}{{ extra or '' }}"
    )
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {}}}]
    [offline] = llm.chat(
        messages,
        SamplingParams(temperature=0, max_tokens=8),
        use_tqdm=False,
        chat_template=template,
        tools=tools,
        chat_template_kwargs={"extra": "!"},
    )
    assert offline.prompt.startswith(
        "user: Weather in Paris? [1 tools]assistant: Paris"
    )
    result = server.client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=8,
        temperature=0,
        tools=tools,
        extra_body={"chat_template": template, "chat_template_kwargs": {"extra": "!"}},
    )
    assert result.choices[0].message.content == offline.outputs[0].text
    assert result.usage.prompt_tokens == len(offline.prompt_token_ids)
    tokenized = post(
        server,
        "/tokenize",
        messages=messages,
        chat_template=template,
        tools=tools,
        chat_template_kwargs={"extra": "!"},
    ).json()
    assert tokenized["tokens"] == offline.prompt_token_ids


def test_continue_final_message_and_no_generation_prompt(server, llm):
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "It is"},
    ]
    [offline] = llm.chat(
        messages,
        SamplingParams(temperature=0, max_tokens=6),
        use_tqdm=False,
        add_generation_prompt=False,
        continue_final_message=True,
    )
    body = post(
        server,
        "/v1/chat/completions",
        messages=messages,
        max_tokens=6,
        temperature=0,
        add_generation_prompt=False,
        continue_final_message=True,
    ).json()
    assert body["choices"][0]["message"]["content"] == offline.outputs[0].text
    assert body["usage"]["prompt_tokens"] == len(offline.prompt_token_ids)


@pytest.mark.parametrize(
    "path, body, param, message",
    [
        (
            "/v1/completions",
            {"prompt": "hi", "suffix": "end"},
            "suffix",
            "fill-in-the-middle",
        ),
        (
            "/v1/completions",
            {"prompt": "hi", "best_of": 3},
            None,
            "best_of=3 > n=1 is not supported",
        ),
        (
            "/v1/completions",
            {"prompt": "hi", "use_beam_search": True, "top_p": 0.5},
            None,
            "use_beam_search does not take top_p",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "hi"}],
                "use_beam_search": True,
                "stream": True,
            },
            None,
            "use_beam_search does not take stream",
        ),
        (
            "/v1/completions",
            {"prompt": "hi", "length_penalty": 0.5},
            None,
            "length_penalty is beam search's: it needs use_beam_search",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "hi"}],
                "response_format": {"type": "text"},
                "reasoning_effort": "low",
            },
            "reasoning_effort",
            "reasoning_effort is not supported",
        ),
        (
            "/v1/completions",
            {"prompt": "hi", "max_tokens": 600},
            None,
            "maximum context length is 512 tokens. However, you requested 602 tokens",
        ),
        (
            "/v1/completions",
            {"prompt": "hi", "logit_bias": {"x": 1}},
            "logit_bias",
            "logit_bias must have token ids as keys",
        ),
        (
            "/v1/completions",
            {"prompt": "hi", "stream_options": {"include_usage": True, "x": 1}},
            "stream_options",
            "stream_options must be an object with include_usage",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "hi"}],
                "add_generation_prompt": "yes",
            },
            "add_generation_prompt",
            "add_generation_prompt must be true or false",
        ),
    ],
)
def test_fields_that_are_not_honoured_are_refused_by_name(
    server, path, body, param, message
):
    response = post(server, path, **body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert message in error["message"] and error["param"] == param


def test_tokenize_and_detokenize_as_vllm(server, llm):
    tokenized = post(server, "/tokenize", prompt=PROMPT, return_token_strs=True).json()
    ids = llm.tokenizer.encode(PROMPT)
    assert tokenized == {
        "count": len(ids),
        "max_model_len": 512,
        "tokens": ids,
        "token_strs": llm.tokenizer.convert_ids_to_tokens(ids),
    }
    assert post(server, "/detokenize", tokens=ids).json() == {"prompt": PROMPT}
    assert post(server, "/detokenize", tokens=[99999]).status_code == 400
    info = httpx.get(server.url + "/tokenizer_info").json()
    assert info["eos_token"] == llm.tokenizer.eos_token and info["chat_template"]


def test_models_version_and_not_found(server):
    [card] = server.client.models.list().data
    assert card.id == "tiny" and card.max_model_len == 512
    assert server.client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        server.client.models.retrieve("other")
    assert httpx.get(server.url + "/version").json()["version"]
    missing = httpx.get(server.url + "/v1/nothing-here")
    assert missing.status_code == 404 and set(missing.json()["error"]) == {
        "message",
        "type",
        "param",
        "code",
    }


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "nanopaged", "serve", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=ROOT, HF_HUB_OFFLINE="1"),
    )


def test_the_command_line_as_a_newcomer_meets_it(qwen3_path, tmp_path):
    help_text = run_cli("--help").stdout
    assert "--max-model-len" in help_text and "longest prompt + completion" in help_text
    assert "(default: 512)" in help_text  # max_num_seqs
    for args, message in [
        ((qwen3_path, "--max-num-seqs", "0"), "max_num_seqs must be >= 1"),
        ((str(tmp_path / "none"),), f"'{tmp_path / 'none'}': no such directory"),
    ]:
        result = run_cli(*args)
        assert result.returncode != 0 and "Traceback" not in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1 and message in result.stderr


def test_the_command_says_its_commands_and_refuses_others():
    def nanopaged(*args):
        return subprocess.run(
            [sys.executable, "-m", "nanopaged", *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            env=dict(os.environ, PYTHONPATH=ROOT),
        )

    for help_args in ((), ("--help",)):
        result = nanopaged(*help_args)
        assert result.returncode == 0 and "commands:\n  serve " in result.stdout
        assert result.stdout.startswith("usage: nanopaged serve MODEL [options]")
    result = nanopaged("server", "tiny")
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "unknown command 'server'" in result.stderr


def test_a_port_in_use_is_said_before_the_model_loads(tmp_path):
    """The port is tried first: with a model that does not exist, the port is what is
    wrong (the model would take a while to load)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_cli(str(tmp_path / "none"), "--port", str(port))
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr


@pytest.mark.parametrize(
    "entry",
    [
        ("-m", "nanopaged.serving.server", "{model}"),
        ("-m", "nanopaged.entrypoints.openai.api_server", "--model", "{model}"),
    ],
)
def test_the_server_at_its_module_paths(qwen3_path, entry):
    """`python -m nanopaged.serving.server MODEL` and vLLM's `python -m
    nanopaged.entrypoints.openai.api_server --model MODEL` serve as `nanopaged serve`
    does."""
    server = Server(
        qwen3_path, entry=tuple(arg.format(model=qwen3_path) for arg in entry)
    )
    try:
        assert [
            m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]
        ] == ["tiny"]
        completion = server.client.completions.create(
            model="tiny", prompt=[5, 6, 7], max_tokens=3, temperature=0
        )
        assert completion.choices[0].finish_reason in ("stop", "length")
    finally:
        server.stop()


def test_a_shutdown_mid_stream_ends_the_stream_cleanly(qwen3_path):
    server = Server(qwen3_path, *OPTIONS)
    with httpx.stream(
        "POST",
        server.url + "/v1/completions",
        timeout=60,
        json={"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True},
    ) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        server.process.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line.startswith("data:")]
    message = json.loads(rest[-2][5:])["error"]["message"]
    assert rest[-1] == "data: [DONE]" and "the server is shutting down" in message
    assert "failed" not in message  # nothing crashed
    server.process.wait(timeout=60)
    assert "CancelledError" not in server.process.stderr.read()


def test_the_random_checkpoint_command_says_what_it_wrote(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "nanopaged.random_checkpoint", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )
    assert result.returncode == 0 and str(tmp_path) in result.stdout
    assert "nanopaged serve" in result.stdout
    assert (
        LLM(str(tmp_path), max_model_len=64)
        .generate("hi", SamplingParams(max_tokens=2), use_tqdm=False)[0]
        .outputs[0]
        .token_ids
    )


def test_the_request_of_vllms_benchmark_serving_openai_chat_backend(server, llm):
    """The payload vLLM's benchmark_serving.py sends with `--backend openai-chat`, read
    the way it reads the stream: content deltas, then the usage."""
    prompt = "Paged attention stores the cache in blocks. " * 20
    payload = {
        "model": "tiny",
        "messages": [{"role": "user", "content": [{"type": "text", "text": prompt}]}],
        "temperature": 0.0,
        "max_completion_tokens": 12,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    generated, usage = "", None
    with httpx.stream(
        "POST",
        server.url + "/v1/chat/completions",
        json=payload,
        headers={"Authorization": "Bearer none"},
        timeout=60,
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            chunk = line.removeprefix("data: ")
            if not line or chunk == "[DONE]":
                continue
            data = json.loads(chunk)
            if data["choices"]:
                generated += data["choices"][0]["delta"].get("content") or ""
            usage = data.get("usage") or usage
    [offline] = llm.chat(
        [{"role": "user", "content": prompt}],
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        use_tqdm=False,
    )
    assert generated == offline.outputs[0].text and usage["completion_tokens"] == 12
