"""The OpenAI-compatible server, started on 127.0.0.1 in a subprocess and driven by the
official `openai` client: the same tokens as `LLM.generate`, requests that arrive while
others decode, dropped clients, bad requests, and a clean exit."""

import concurrent.futures
import os
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest
from conftest import ctrl_c_as_at_a_terminal, random_prompts

from nanopaged import LLM, SamplingParams
from nanopaged.parallel.tensor import free_port

openai = pytest.importorskip("openai")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPTIONS = ["--max-model-len", "512", "--kvcache-block-size", "16"]


class Server:
    """`nanopaged serve MODEL --port P --served-model-name tiny FLAGS`, or another entry
    point's command line before the port (`entry`)."""

    def __init__(self, model: str, *flags: str, entry: tuple[str, ...] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        entry = entry or ("-m", "nanopaged", "serve", model)
        self.process = subprocess.Popen(
            [
                sys.executable,
                *entry,
                "--port",
                str(self.port),
                "--served-model-name",
                "tiny",
                *flags,
            ],
            cwd=ROOT,
            env=dict(os.environ, PYTHONPATH=ROOT),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=ctrl_c_as_at_a_terminal,
        )
        deadline = time.monotonic() + 120
        while not self.healthy():
            assert self.process.poll() is None, self.process.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)
        self.client = openai.OpenAI(
            base_url=self.url + "/v1", api_key="none", max_retries=0
        )

    def healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def metrics(self) -> dict[str, int]:
        text = httpx.get(self.url + "/metrics").text
        return {line.split()[0]: int(line.split()[1]) for line in text.splitlines()}

    def stop(self) -> bool:
        """SIGTERM; whether the server shut down gracefully (uvicorn then exits by the
        signal)."""
        self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(timeout=60)
        self.log = self.process.stderr.read()  # what it printed, for a test to read
        return (
            code in (0, -signal.SIGTERM) and "Application shutdown complete" in self.log
        )


@pytest.fixture(scope="module", params=["prefill-first", "mixed"])
def server(request, qwen3_path):
    server = Server(
        qwen3_path,
        *OPTIONS,
        "--scheduling",
        request.param,
        "--max-num-batched-tokens",
        "64",
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def offline(qwen3_path):
    llm = LLM(qwen3_path, max_model_len=512, kvcache_block_size=16)

    def generate(prompt, **params):
        [output] = llm.generate([prompt], SamplingParams(**params), use_tqdm=False)
        return [c.text for c in output.outputs], output

    generate.llm = llm
    return generate


def test_completions_equal_generate(server, offline):
    prompt = "Paged attention stores the key and value cache"
    texts, expected = offline(prompt, temperature=0, max_tokens=20, logprobs=0)
    result = server.client.completions.create(
        model="tiny", prompt=prompt, max_tokens=20, temperature=0, logprobs=0
    )
    [choice] = result.choices
    assert (
        choice.text == texts[0]
        and choice.finish_reason == expected.outputs[0].finish_reason
    )
    tokens = expected.outputs[0].token_ids
    assert choice.logprobs.tokens == [offline.llm.tokenizer.decode([t]) for t in tokens]
    assert choice.logprobs.token_logprobs == pytest.approx(
        [e[t].logprob for t, e in zip(tokens, expected.outputs[0].logprobs)], abs=1e-5
    )
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (
        len(expected.prompt_token_ids),
        len(tokens),
    )
    streamed = server.client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == texts[0]
    assert chunks[-1].usage.completion_tokens == len(tokens)


def test_token_id_prompts_and_several_prompts(server, offline):
    prompts = random_prompts([5, 17], seed=60)
    result = server.client.completions.create(
        model="tiny", prompt=prompts, max_tokens=8, temperature=0, n=2
    )
    assert [c.index for c in result.choices] == [0, 1, 2, 3]
    for i, prompt in enumerate(prompts):
        texts, _ = offline(prompt, temperature=0, max_tokens=8)
        assert [c.text for c in result.choices[2 * i : 2 * i + 2]] == texts * 2


def test_chat_equals_generate_on_the_template(server, offline):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Introduce yourself."},
    ]
    ids = offline.llm.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    texts, expected = offline(ids, temperature=0, max_tokens=16)
    result = server.client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=16, temperature=0
    )
    assert (
        result.choices[0].message.content == texts[0]
        and result.choices[0].message.role == "assistant"
    )
    assert result.usage.prompt_tokens == len(ids)
    chunks = list(
        server.client.chat.completions.create(
            model="tiny",
            messages=messages,
            temperature=0,
            max_completion_tokens=16,
            stream=True,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == texts[0]
    assert chunks[-1].choices[0].finish_reason == expected.outputs[0].finish_reason


def test_concurrent_streams_each_equal_their_offline_result(server, offline):
    assert_concurrent_streams_equal_offline(server, offline)


def test_speculative_decoding_serves_the_same_tokens(qwen3_path, offline):
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'
    server = Server(qwen3_path, *OPTIONS, "--speculative-config", spec)
    try:
        assert_concurrent_streams_equal_offline(server, offline)
        metrics = server.metrics()
        assert metrics["nanopaged_spec_decode_num_accepted_tokens_total"] > 0
        assert (
            metrics["nanopaged_kv_blocks_free"] == metrics["nanopaged_kv_blocks_total"]
        )
    finally:
        server.stop()


def assert_concurrent_streams_equal_offline(server, offline):
    prompts = random_prompts([5, 40, 12, 90, 23, 61, 7, 33] * 4, seed=61)

    def params(i):
        return dict(
            temperature=0,
            max_tokens=8 + 3 * (i % 7),
            n=2 if i % 5 == 0 else 1,
            stop=["e"] if i % 4 == 1 else None,
        )

    def stream(i):
        p = params(i)
        chunks = server.client.completions.create(
            model="tiny", prompt=prompts[i], stream=True, **p
        )
        texts = ["", ""][: p["n"]]
        for chunk in chunks:
            for choice in chunk.choices:
                texts[choice.index] += choice.text
        return texts

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        results = list(pool.map(stream, range(32)))
    assert [offline(prompts[i], **params(i))[0] for i in range(32)] == results


def test_a_dropped_stream_frees_its_blocks(server, offline):
    with httpx.stream(
        "POST",
        server.url + "/v1/completions",
        timeout=60,
        json={
            "prompt": random_prompts([60], seed=62)[0],
            "max_tokens": 400,
            "ignore_eos": True,
            "stream": True,
        },
    ) as response:
        for line in response.iter_lines():
            if line.startswith("data:"):
                break  # the client goes away mid-stream
    deadline = time.monotonic() + 30
    while (
        server.metrics()["nanopaged_kv_blocks_free"]
        != server.metrics()["nanopaged_kv_blocks_total"]
    ):
        assert time.monotonic() < deadline, server.metrics()
        time.sleep(0.1)
    assert server.metrics()["nanopaged_sequences_running"] == 0
    texts, _ = offline([5, 6, 7], temperature=0, max_tokens=4)
    assert (
        server.client.completions.create(
            model="tiny", prompt=[5, 6, 7], max_tokens=4, temperature=0
        )
        .choices[0]
        .text
        == texts[0]
    )


@pytest.mark.parametrize(
    "path, body, status, param, message",
    [
        ("/v1/completions", b"{not json", 400, None, "not valid JSON"),
        ("/v1/completions", [1, 2], 400, None, "must be a JSON object"),
        (
            "/v1/completions",
            {"prompt": "hi", "model": "gpt-4"},
            404,
            "model",
            "'gpt-4' does not exist",
        ),
        ("/v1/completions", {"max_tokens": 4}, 400, "prompt", "prompt must be"),
        (
            "/v1/completions",
            {"prompt": "hi", "temperature": -1},
            400,
            "temperature",
            "temperature must be",
        ),
        (
            "/v1/completions",
            {"prompt": "hi", "max_tokens": "many"},
            400,
            "max_tokens",
            "max_tokens must be",
        ),
        ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n", "n must be"),
        (
            "/v1/completions",
            {"prompt": [1, 99999]},
            400,
            None,
            "outside the vocabulary",
        ),
        (
            "/v1/completions",
            {"prompt": "", "max_tokens": 4},
            400,
            None,
            "prompt is empty",
        ),
        (
            "/v1/chat/completions",
            {"messages": "hi"},
            400,
            "messages",
            "messages must be",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user"}]},
            400,
            "messages",
            "message 0 has no content",
        ),
        (
            "/v1/completions",
            b'{"prompt": "\\ud800 hi"}',
            400,
            None,
            "prompt is not valid Unicode",
        ),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
            400,
            "messages",
            "message 0's content is not valid Unicode",
        ),
        (
            "/v1/completions",
            {"prompt": "hi", "stop": True},
            400,
            "stop",
            "stop must be",
        ),
        ("/v1/completions", {"prompt": "hi", "stop": 5}, 400, "stop", "stop must be"),
        ("/v1/completions", b"[" * 100000 + b"]" * 100000, 400, None, "not valid JSON"),
        (
            "/v1/completions",
            {"prompt": "hi", "stream": True, "stream_options": "yes"},
            400,
            "stream_options",
            "stream_options must be an object",
        ),
    ],
)
def test_bad_requests_get_their_status_and_an_openai_error(
    server, path, body, status, param, message
):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    response = httpx.post(server.url + path, timeout=30, **kwargs)
    assert response.status_code == status
    error = response.json()["error"]
    assert (
        set(error) == {"message", "type", "param", "code"} and error["param"] == param
    )
    assert message in error["message"]
    assert server.healthy() and server.metrics()["nanopaged_requests_waiting"] == 0


def test_a_client_that_hangs_up_before_a_whole_response_frees_its_request(server):
    """Not streamed: the server has nothing to send until the end, and must notice
    anyway."""
    generated = server.metrics()["nanopaged_generation_tokens_total"]
    body = {
        "prompt": random_prompts([10], seed=63)[0],
        "max_tokens": 500,
        "n": 16,  # 500 steps of 16 rows: longer than the server takes to notice
        "ignore_eos": True,
    }
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", timeout=0.3, json=body)
    deadline = time.monotonic() + 30
    while server.metrics()["nanopaged_sequences_running"] != 0:
        assert time.monotonic() < deadline, server.metrics()
        time.sleep(0.1)
    metrics = server.metrics()
    assert metrics["nanopaged_kv_blocks_free"] == metrics["nanopaged_kv_blocks_total"]
    assert metrics["nanopaged_requests_waiting"] == 0
    # aborted: it did not run its 500 steps to the end
    assert metrics["nanopaged_generation_tokens_total"] - generated < 500 * 16


def test_a_request_that_breaks_the_tokenizer_leaves_the_server_serving(server, offline):
    bad = httpx.post(
        server.url + "/v1/completions",
        timeout=30,
        content=b'{"prompt": "\\ud800", "max_tokens": 4}',
    )
    assert bad.status_code == 400 and server.healthy()
    texts, _ = offline([5, 6, 7], temperature=0, max_tokens=4)
    assert (
        server.client.completions.create(
            model="tiny", prompt=[5, 6, 7], max_tokens=4, temperature=0
        )
        .choices[0]
        .text
        == texts[0]
    )


def test_too_many_waiting_requests_get_503_and_too_large_ones_400(qwen3_path):
    server = Server(
        qwen3_path, *OPTIONS, "--max-waiting", "1", "--num-kvcache-blocks", "30"
    )
    try:
        too_large = httpx.post(
            server.url + "/v1/completions",
            timeout=30,
            json={"prompt": random_prompts([400])[0], "max_tokens": 100},
        )
        assert too_large.status_code == 400
        assert "needs up to 32 KV-cache blocks" in too_large.json()["error"]["message"]

        def post(i):
            return httpx.post(
                server.url + "/v1/completions",
                timeout=60,
                json={"prompt": random_prompts([400], seed=i)[0], "max_tokens": 4},
            )

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            responses = list(pool.map(post, range(16)))
        codes = sorted(r.status_code for r in responses)
        assert set(codes) == {200, 503} and codes.count(200) >= 1
        busy = next(r for r in responses if r.status_code == 503).json()["error"]
        assert (
            "more than 1 requests are waiting" in busy["message"]
            and busy["type"] == "server_error"
        )
        # on an idle server, a batch larger than --max-waiting runs: it never could
        # later
        batch = server.client.completions.create(
            model="tiny", prompt=["hi", "there", "you"], max_tokens=2
        )
        assert len(batch.choices) == 3
    finally:
        assert server.stop()


def test_sigterm_stops_the_server_and_its_tensor_parallel_workers(qwen3_path, offline):
    server = Server(qwen3_path, *OPTIONS, "--tensor-parallel-size", "2")
    children = psutil.Process(server.process.pid).children(recursive=True)
    assert children  # the worker of rank 1
    result = server.client.completions.create(
        model="tiny", prompt=[5, 6, 7], max_tokens=8, temperature=0
    )
    assert (
        result.choices[0].text == offline([5, 6, 7], temperature=0, max_tokens=8)[0][0]
    )
    assert server.stop()
    psutil.wait_procs(children, timeout=30)
    assert not any(
        c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children
    )


def test_ctrl_c_shuts_the_server_down_with_one_line(qwen3_path):
    """As a command-line tool: a clean shutdown, then "interrupted", no traceback."""
    server = Server(qwen3_path, *OPTIONS)
    server.process.send_signal(signal.SIGINT)
    assert server.process.wait(timeout=60) == 1
    log = server.process.stderr.read()
    assert "Application shutdown complete" in log and "Traceback" not in log
    assert log.splitlines()[-1] == "interrupted"


def test_two_replicas_serve_the_same_tokens_and_route_by_prefix(qwen3_path, offline):
    server = Server(qwen3_path, *OPTIONS, "--data-parallel-size", "2")
    try:
        assert_concurrent_streams_equal_offline(server, offline)
        before = server.metrics()
        routed = [
            before[
                f'nanopaged_router_requests_total{{replica="{i}",reason="least_busy"}}'
            ]
            + before[
                f'nanopaged_router_requests_total{{replica="{i}",reason="prefix"}}'
            ]
            for i in range(2)
        ]
        assert sum(routed) == 32 and min(routed) > 0  # both replicas served
        shared = random_prompts([48], seed=63)[0]  # three whole blocks
        for tail in random_prompts([5, 6, 7, 8], seed=64):
            server.client.completions.create(
                model="tiny", prompt=shared + tail, max_tokens=2
            )
        after = server.metrics()
        prefix_hits = [
            after[f'nanopaged_router_requests_total{{replica="{i}",reason="prefix"}}']
            - before[
                f'nanopaged_router_requests_total{{replica="{i}",reason="prefix"}}'
            ]
            for i in range(2)
        ]
        assert sorted(prefix_hits) == [0, 3]  # after the first, all went where it went
        for name in ("generation_tokens_total", "kv_blocks_total"):
            assert after[f"nanopaged_{name}"] == sum(
                after[f'nanopaged_{name}{{replica="{i}"}}'] for i in range(2)
            )
        replicas = [
            p
            for p in psutil.Process(server.process.pid).children(recursive=True)
            if "resource_tracker" not in " ".join(p.cmdline())
        ]
        assert len(replicas) == 2
        replicas[0].kill()  # a replica dies: the server says so, and the other serves
        results = []
        for _ in range(3):
            try:
                results.append(
                    server.client.completions.create(
                        model="tiny", prompt=shared, max_tokens=2
                    )
                    .choices[0]
                    .text
                )
            except openai.InternalServerError as error:
                results.append(error)
        assert isinstance(results[-1], str) and not server.healthy()
    finally:
        assert server.stop()
    _, alive = psutil.wait_procs(replicas, timeout=30)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]


def test_a_request_sent_to_a_replica_whose_loop_just_died_is_answered():
    """The router may pick a replica's loop in the moment between its replica's death
    and the loop's knowing it: that request gets the replica's error, not a wait
    forever."""
    import asyncio

    from nanopaged.engine.data_parallel import ReplicaDied
    from nanopaged.serving.server import EngineLoop

    class DeadReplica:
        def is_finished(self) -> bool:
            return False

        def step(self, *request):
            raise ReplicaDied("replica 0 died")

        add_request = abort = step

    loop = EngineLoop(DeadReplica(), max_waiting=4)
    deadline = time.monotonic() + 10
    while loop.is_alive():  # its first step finds the replica dead
        assert time.monotonic() < deadline
        time.sleep(0.01)

    async def submit():
        future = loop.submit("r", {"prompt": "hi"}, None, asyncio.Queue())
        await asyncio.wait_for(asyncio.wrap_future(future), timeout=10)

    with pytest.raises(ReplicaDied, match="replica 0 died"):
        asyncio.run(submit())
    loop.abort("r")
    loop.stop()
