"""The server's pooling endpoints, for an engine that pools (`runner="pooling"`):
OpenAI's `/v1/embeddings` (`encoding_format` float or base64, `dimensions`, texts or
token ids, one or a batch), vLLM's `/classify`, `/score` (and `/v1/score`) and `/rerank`
(and `/v1/rerank`, `/v2/rerank`). Each input is one engine request, run by the same
engine loop as completions; a field nanopaged does not implement is a 400 naming it."""

import base64
import time
import uuid
from dataclasses import dataclass

import numpy as np
from fastapi import FastAPI, Request

from nanopaged.pooling.params import PoolingParams
from nanopaged.pooling.pooling_llm import paired
from nanopaged.serving.openai_responses import (
    Response,
    bad_request,
    read_body,
)

EMBEDDING_FIELDS = {
    "model",
    "input",
    "encoding_format",
    "dimensions",
    "user",
    "truncate_prompt_tokens",
    "normalize",
}
SCORE_FIELDS = {"model", "text_1", "text_2", "queries", "documents", "user"}
SCORE_FIELDS |= {"truncate_prompt_tokens", "use_activation"}
RERANK_FIELDS = {"model", "query", "documents", "top_n", "user"}
RERANK_FIELDS |= {"truncate_prompt_tokens", "use_activation", "return_documents"}
MAX_INPUTS = 2048  # a request's inputs, at most (OpenAI's embeddings take as many)
CLASSIFY_FIELDS = {"model", "input", "user", "truncate_prompt_tokens", "use_activation"}


@dataclass
class PoolingBatch:
    """The inputs of one HTTP request, in the shape `Response` runs: prompts and one
    PoolingParams for all."""

    prompts: list
    params: PoolingParams
    stream: bool = False


def check_fields(body: dict, allowed: set[str]) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise ValueError(f"{unknown[0]} is not supported by this endpoint")


def inputs(value, name: str = "input") -> list:
    """OpenAI's `input`: a text, a list of texts, token ids, or a list of those; as
    prompts."""
    if isinstance(value, str) or (
        isinstance(value, list) and value and all(isinstance(v, int) for v in value)
    ):
        value = [value]
    if not isinstance(value, list) or not value:
        raise ValueError(
            f"{name} must be a text, token ids, or a non-empty list of them"
        )
    if len(value) > MAX_INPUTS:
        raise ValueError(
            f"{name} holds {len(value)} inputs; a request takes at most {MAX_INPUTS} "
            f"(OpenAI's limit): send them in several requests"
        )
    prompts = []
    for item in value:
        if isinstance(item, str):
            prompts.append({"prompt": item})
        elif isinstance(item, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in item
        ):
            prompts.append({"prompt_token_ids": item})
        else:
            raise ValueError(f"{name} must hold texts or lists of token ids")
    return prompts


def params_of(body: dict, task: str) -> PoolingParams:
    fields = ("dimensions", "normalize", "use_activation", "truncate_prompt_tokens")
    return PoolingParams(task=task, **{f: body[f] for f in fields if f in body})


async def run(request: Request, engine, batch: PoolingBatch, model: str):
    """The outputs of every input, in order; or the error response."""
    return await Response(request, engine, batch, False, model).run()


def usage(outputs) -> dict:
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return {"prompt_tokens": tokens, "total_tokens": tokens}


def embedding_data(outputs, encoding: str) -> list[dict]:
    data = []
    for i, output in enumerate(outputs):
        vector = output.outputs.embedding
        if encoding == "base64":  # little-endian float32, as OpenAI's client reads it
            vector = base64.b64encode(np.array(vector, "<f4").tobytes()).decode()
        data.append({"object": "embedding", "index": i, "embedding": vector})
    return data


def add_pooling_routes(app: FastAPI, engine, models) -> None:
    """The pooling endpoints of `engine` (an engine loop) serving `models`."""
    llm = engine.llm

    async def body_of(request: Request, allowed: set[str]):
        body = await read_body(request)
        if not isinstance(body, dict):
            return body, None
        name = body.get("model", models.base)
        if name != models.base:
            return models.not_found(name), None
        try:
            check_fields(body, allowed)
        except ValueError as error:
            return bad_request(error), None
        return body, name

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        body, model = await body_of(request, EMBEDDING_FIELDS)
        if model is None:
            return body
        encoding = body.get("encoding_format", "float")
        try:
            if encoding not in ("float", "base64"):
                raise ValueError("encoding_format must be 'float' or 'base64'")
            batch = PoolingBatch(inputs(body.get("input")), params_of(body, "embed"))
        except (ValueError, TypeError) as error:
            return bad_request(ValueError(str(error)))
        outputs = await run(request, engine, batch, model)
        if not isinstance(outputs, list):
            return outputs
        return {
            "object": "list",
            "data": embedding_data(outputs, encoding),
            "model": model,
            "usage": usage(outputs),
        }

    @app.post("/classify")
    async def classify(request: Request):
        body, model = await body_of(request, CLASSIFY_FIELDS)
        if model is None:
            return body
        try:
            batch = PoolingBatch(inputs(body.get("input")), params_of(body, "classify"))
        except (ValueError, TypeError) as error:
            return bad_request(ValueError(str(error)))
        outputs = await run(request, engine, batch, model)
        if not isinstance(outputs, list):
            return outputs
        labels = getattr(llm.config.hf_config, "id2label", None) or {}
        data = []
        for i, output in enumerate(outputs):
            probs = output.outputs.probs
            label = labels.get(int(np.argmax(probs)))
            data.append(
                {"index": i, "label": label, "probs": probs, "num_classes": len(probs)}
            )
        return envelope("classify", model, data, outputs)

    async def scores(request: Request, queries, documents, body: dict, model: str):
        """The score of each (query, document) pair, in order; or the error response."""
        first, second = inputs(queries, "text_1"), inputs(documents, "text_2")
        queries = paired(first, second, "text_1")
        if llm.classifier:
            pairs = [llm.pair_prompt(*pair) for pair in zip(queries, second)]
            batch = PoolingBatch(pairs, params_of(body, "score"))
            outputs = await run(request, engine, batch, model)
            if not isinstance(outputs, list):
                return outputs, None
            return [o.outputs.score for o in outputs], outputs
        # each input embedded (and counted in the usage) once
        batch = PoolingBatch(first + second, params_of(body, "embed"))
        outputs = await run(request, engine, batch, model)
        if not isinstance(outputs, list):
            return outputs, None
        vectors = [np.array(o.outputs.embedding) for o in outputs]
        by_pair = paired(vectors[: len(first)], second, "text_1")
        cosines = [cosine(a, b) for a, b in zip(by_pair, vectors[len(first) :])]
        return cosines, outputs

    @app.post("/score")
    @app.post("/v1/score")
    async def score(request: Request):
        body, model = await body_of(request, SCORE_FIELDS)
        if model is None:
            return body
        queries = body.get("text_1", body.get("queries"))
        documents = body.get("text_2", body.get("documents"))
        try:
            values, outputs = await scores(request, queries, documents, body, model)
        except (ValueError, TypeError) as error:
            return bad_request(ValueError(str(error)))
        if outputs is None:
            return values
        data = [
            {"index": i, "object": "score", "score": v} for i, v in enumerate(values)
        ]
        return envelope("score", model, data, outputs)

    @app.post("/rerank")
    @app.post("/v1/rerank")
    @app.post("/v2/rerank")
    async def rerank(request: Request):
        body, model = await body_of(request, RERANK_FIELDS)
        if model is None:
            return body
        query, documents = body.get("query"), body.get("documents")
        top_n = body.get("top_n") or None  # 0: every document, as vLLM's
        try:
            if not isinstance(query, str):
                raise ValueError("query must be a text")
            if not isinstance(documents, list) or not all(
                isinstance(d, str) for d in documents
            ):
                raise ValueError("documents must be a list of texts")
            if top_n is not None and not (
                isinstance(top_n, int) and not isinstance(top_n, bool) and top_n > 0
            ):
                raise ValueError("top_n must be a positive integer")
            values, outputs = await scores(request, query, documents, body, model)
        except (ValueError, TypeError) as error:
            return bad_request(ValueError(str(error)))
        if outputs is None:
            return values
        order = sorted(range(len(values)), key=lambda i: -values[i])[:top_n]
        results = [
            {
                "index": i,
                "document": {"text": documents[i]},
                "relevance_score": values[i],
            }
            for i in order
        ]
        return {
            "id": f"rerank-{uuid.uuid4().hex}",
            "model": model,
            "usage": {"total_tokens": usage(outputs)["total_tokens"]},
            "results": results,
        }


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-12))


def envelope(kind: str, model: str, data: list, outputs) -> dict:
    return {
        "id": f"{kind}-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": data,
        "usage": usage(outputs),
    }
