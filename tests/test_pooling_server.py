"""The server's pooling endpoints (nanopaged/serving/pooling_api.py) give what the
engine gives offline, through OpenAI's client where it has them; no value of any field
is a 500."""

import base64
import json
import socket
import time

import httpx
import numpy as np
import pytest
from test_openai_api import BAD_VALUES
from test_pooling import TEXTS, classifier_paths, st_path  # noqa: F401 (fixtures)
from test_server import Server

from nanopaged import LLM

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def embedding_server(st_path):  # noqa: F811
    server = Server(st_path, "--max-num-batched-tokens", "16")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def offline(st_path):  # noqa: F811
    return LLM(st_path, num_kvcache_blocks=64)


def post(server, path: str, **body) -> httpx.Response:
    return httpx.post(server.url + path, json=dict(model="tiny", **body), timeout=60)


def test_embeddings_through_the_openai_client(embedding_server, offline):
    client = openai.OpenAI(base_url=embedding_server.url + "/v1", api_key="x")
    want = np.array([o.outputs.embedding for o in offline.embed(TEXTS)])
    # the client asks for base64 unless told otherwise, and decodes it
    for encoding in ({}, {"encoding_format": "float"}):
        response = client.embeddings.create(model="tiny", input=TEXTS, **encoding)
        got = np.array([d.embedding for d in response.data])
        assert np.abs(got - want).max() < 1e-5
    data = post(
        embedding_server, "/v1/embeddings", input=TEXTS[0], encoding_format="base64"
    )
    vector = np.frombuffer(base64.b64decode(data.json()["data"][0]["embedding"]), "<f4")
    assert np.abs(vector - want[0]).max() < 1e-5
    ids = offline.tokenizer("hello world")["input_ids"]
    one = client.embeddings.create(model="tiny", input=ids)
    [from_ids] = offline.embed([ids], use_tqdm=False)
    assert (
        np.abs(np.array(one.data[0].embedding) - from_ids.outputs.embedding).max()
        < 1e-5
    )
    assert one.usage.prompt_tokens == len(ids)
    response = post(embedding_server, "/v1/embeddings", input="a", dimensions=8)
    assert response.status_code == 400
    assert "Matryoshka" in response.json()["error"]["message"]


def test_score_and_rerank_of_an_embedding_model(embedding_server, offline):
    want = [o.outputs.score for o in offline.score(TEXTS[0], TEXTS[1:])]
    data = post(embedding_server, "/score", text_1=TEXTS[0], text_2=TEXTS[1:]).json()
    assert [d["score"] for d in data["data"]] == pytest.approx(want, abs=1e-5)
    # each input embedded and counted once: the query is not one per document
    lengths = [len(o.prompt_token_ids) for o in offline.embed(TEXTS, use_tqdm=False)]
    assert data["usage"]["prompt_tokens"] == sum(lengths)
    ranked = post(
        embedding_server, "/rerank", query=TEXTS[0], documents=TEXTS[1:], top_n=2
    ).json()["results"]
    order = sorted(range(3), key=lambda i: -want[i])[:2]
    assert [r["index"] for r in ranked] == order
    assert [r["relevance_score"] for r in ranked] == pytest.approx(
        [want[i] for i in order], abs=1e-5
    )
    assert ranked[0]["document"]["text"] == TEXTS[1:][order[0]]


def test_a_classifier_server_classifies_and_scores(classifier_paths):  # noqa: F811
    offline = LLM(classifier_paths[1])
    server = Server(classifier_paths[1])
    try:
        want = [o.outputs.score for o in offline.score("hello", TEXTS)]
        data = post(server, "/v1/score", text_1="hello", text_2=TEXTS).json()["data"]
        assert [d["score"] for d in data] == pytest.approx(want, abs=1e-5)
        probs = [o.outputs.probs for o in offline.classify(TEXTS)]
        data = post(server, "/classify", input=TEXTS).json()["data"]
        assert np.allclose([d["probs"] for d in data], probs, atol=1e-5)
        # a pooling engine does not generate: the completions say so, and where to go
        for path, body in (
            ("/v1/completions", {"prompt": "hi"}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ):
            response = post(server, path, **body)
            assert response.status_code == 400
            message = response.json()["error"]["message"]
            assert "cannot generate" in message and "/v1/embeddings" in message
            assert "Params" not in message
    finally:
        server.stop()


@pytest.mark.parametrize("path", ["/v1/embeddings", "/score", "/rerank", "/classify"])
def test_no_value_of_any_field_is_a_500(embedding_server, path):
    from nanopaged.serving import pooling_api

    fields = {
        "/v1/embeddings": (pooling_api.EMBEDDING_FIELDS, {"input": "hi"}),
        "/score": (pooling_api.SCORE_FIELDS, {"text_1": "a", "text_2": "b"}),
        "/rerank": (pooling_api.RERANK_FIELDS, {"query": "a", "documents": ["b"]}),
        "/classify": (pooling_api.CLASSIFY_FIELDS, {"input": "hi"}),
    }
    allowed, base = fields[path]
    with httpx.Client(timeout=120) as client:
        for field in sorted(allowed):
            for value in BAD_VALUES:
                body = {"model": "tiny", **base, field: value}
                response = client.post(embedding_server.url + path, json=body)
                assert response.status_code in (200, 400, 404), (field, value)
                if response.status_code == 400:
                    assert response.json()["error"]["message"], (field, value)
    assert embedding_server.healthy()


def test_a_client_that_goes_away_or_a_big_batch_harms_nothing(st_path):  # noqa: F811
    """A client that disconnects mid-request gets its requests aborted, quietly (no
    traceback, no 500); a batch larger than --max-waiting runs on an idle server; one
    over OpenAI's 2,048 inputs, and top_n=true, are a 400 that says why."""
    server = Server(st_path, "--max-waiting", "4", "--max-num-batched-tokens", "16")
    try:
        # 2,000 inputs at 16 tokens a step: seconds of work; the client is gone after
        # half a second, whatever the machine's speed
        body = json.dumps({"model": "tiny", "input": [TEXTS[1]] * 2000}).encode()
        head = (
            "POST /v1/embeddings HTTP/1.1\r\nHost: localhost\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        with socket.create_connection(("127.0.0.1", server.port)) as client:
            client.sendall(head.encode() + body)
            time.sleep(0.5)
        deadline = time.monotonic() + 60  # the server notices within a second
        while server.metrics()["nanopaged_requests_waiting"]:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        batch = post(server, "/v1/embeddings", input=TEXTS * 3)
        assert batch.status_code == 200 and len(batch.json()["data"]) == 12
        too_many = post(server, "/v1/embeddings", input=["a"] * 2049)
        assert too_many.status_code == 400
        assert "at most 2048" in too_many.json()["error"]["message"]
        rerank = post(server, "/rerank", query="a", documents=["b", "c"], top_n=True)
        assert rerank.status_code == 400
        assert "top_n" in rerank.json()["error"]["message"]
    finally:
        assert server.stop()
    assert "Traceback" not in server.log and "Error" not in server.log


def test_embeddings_with_async_scheduling_are_the_offline_ones(st_path, offline):  # noqa: F811
    """`serve --async-scheduling` on an embedding model: each request's step is read
    before its answer, which is the synchronous engine's."""
    server = Server(st_path, "--async-scheduling")
    try:
        want = np.array([o.outputs.embedding for o in offline.embed(TEXTS)])
        response = post(server, "/v1/embeddings", input=TEXTS)
        got = np.array([d["embedding"] for d in response.json()["data"]])
        assert np.abs(got - want).max() < 1e-5
    finally:
        server.stop()
