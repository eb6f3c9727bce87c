"""An OpenAI-compatible HTTP server: `nanopaged serve MODEL` (or `python -m nanopaged.server MODEL`).

One engine loop runs in a thread of its own and is the only caller of the engine: handlers hand
it requests and aborts through a queue, and after every step it hands each request's outputs to
the handler waiting for them. The engine admits a request that arrives while others decode at
its next step. Needs the `serve` extra: pip install -e ".[serve]".
"""
import argparse
import asyncio
import json
import queue
import re
import sys
import threading
import time
import uuid
from concurrent.futures import Future
from contextlib import asynccontextmanager
from dataclasses import fields
from typing import get_args

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from nanopaged import LLM, RequestOutput, SamplingParams
from nanopaged.config import Config


class EngineLoop:
    """Runs the engine's steps in a thread of its own; sleeps while there is nothing to do."""

    def __init__(self, llm: LLM):
        self.llm = llm
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()  # (function, args) to run on the loop
        self.outboxes: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.running = True
        self.thread = threading.Thread(target=self._run, name="nanopaged-engine", daemon=True)
        self.thread.start()

    def submit(self, request_id: str, prompt, params: SamplingParams,
               outbox: asyncio.Queue) -> Future:
        """Queues a request; the future is done once the engine took it, or holds the error
        (a ValueError: the client's fault) that rejected it. Its outputs, and an exception if a
        step fails, will be put in `outbox`."""
        future: Future = Future()
        loop = asyncio.get_running_loop()
        self.inbox.put((self._add, (request_id, prompt, params, loop, outbox, future)))
        return future

    def abort(self, request_id: str) -> None:
        self.inbox.put((self._abort, (request_id,)))

    def stop(self) -> None:
        self.running = False
        self.inbox.put((lambda: None, ()))
        self.thread.join()

    def _add(self, request_id: str, prompt, params, loop, outbox, future: Future) -> None:
        try:
            self.llm.add_request(prompt, params, request_id=request_id)
        except Exception as error:  # a ValueError is the client's fault; the loop goes on
            future.set_exception(error)
            return
        self.outboxes[request_id] = (loop, outbox)
        future.set_result(None)

    def _abort(self, request_id: str) -> None:
        self.llm.abort(request_id)
        self.outboxes.pop(request_id, None)

    def _run(self) -> None:
        """Serves the inbox and steps the engine until stopped. Nothing a request does can end
        this loop: a failed step fails the requests it held, and the loop goes on."""
        while self.running:
            try:
                if self.llm.is_finished():
                    function, args = self.inbox.get()  # idle: sleep until work arrives
                    function(*args)
                while not self.inbox.empty():
                    function, args = self.inbox.get()
                    function(*args)
                outputs = self.llm.step()
            except Exception as error:  # the engine has aborted every request: tell their handlers
                for loop, outbox in self.outboxes.values():
                    loop.call_soon_threadsafe(outbox.put_nowait, error)
                self.outboxes.clear()
                continue
            for output in outputs:
                take = self.outboxes.pop if output.finished else self.outboxes.get
                loop, outbox = take(output.request_id)
                loop.call_soon_threadsafe(outbox.put_nowait, output)


def error_response(status: int, message: str, param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status)


def bad_request(error: ValueError) -> JSONResponse:
    field = re.match(r"(\w+) must", str(error))  # the engine's messages start with the field
    return error_response(400, str(error), field.group(1) if field else None)


def sampling_params(body: dict, chat: bool) -> SamplingParams:
    """OpenAI's request fields (and vLLM's extras top_k, min_tokens, ignore_eos)."""
    def get(name, default=None):
        return default if body.get(name) is None else body[name]
    logprobs = (get("top_logprobs", 0) if get("logprobs") else None) if chat else get("logprobs")
    return SamplingParams(
        n=get("n", 1), temperature=get("temperature", 1.0), top_p=get("top_p", 1.0),
        top_k=get("top_k", 0), seed=get("seed"), stop=get("stop"), logprobs=logprobs,
        max_tokens=get("max_completion_tokens", get("max_tokens", None if chat else 16)),
        min_tokens=get("min_tokens", 0), ignore_eos=get("ignore_eos", False))


def completion_prompts(body: dict) -> list:
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], int)):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        return prompt
    raise ValueError(f"prompt must be a string, a list of token ids or a list of those, got {prompt!r}")


def chat_prompt(body: dict, llm: LLM) -> dict:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str) for m in messages):
        raise ValueError("messages must be a non-empty list of {role, content} objects with "
                         "string content")
    if not llm.tokenizer.chat_template:
        raise ValueError("messages cannot be used: the model's tokenizer has no chat template")
    return {"prompt_token_ids": llm.render_chat(messages)}


def stream_options(body: dict) -> bool:
    """Whether a streamed response ends with the usage."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise ValueError(f"stream_options must be an object, got {options!r}")
    return bool(options.get("include_usage"))


def logprobs_json(completion, start: int, top: int, chat: bool) -> dict | None:
    """The logprobs of tokens `start:` of a completion, in the chat or the completions format."""
    if completion.logprobs is None:
        return None
    pairs = list(zip(completion.token_ids[start:], completion.logprobs[start:]))
    if not chat:
        return {"tokens": [entries[t].decoded_token for t, entries in pairs],
                "token_logprobs": [entries[t].logprob for t, entries in pairs],
                "top_logprobs": [{lp.decoded_token: lp.logprob for lp in entries.values()}
                                 for _, entries in pairs]}
    def item(lp):
        return {"token": lp.decoded_token, "logprob": lp.logprob, "bytes": list(lp.decoded_token.encode())}
    return {"content": [dict(item(entries[t]), top_logprobs=[item(lp) for lp in entries.values() if lp.rank <= top])
                        for t, entries in pairs]}


class Admission:
    """Counts the requests that wait for their first token, and turns away those beyond a
    limit (503) rather than queue them without bound."""

    def __init__(self, limit: int):
        self.limit, self.waiting = limit, 0

    def enter(self, count: int) -> bool:
        if self.waiting + count > self.limit:
            return False
        self.waiting += count
        return True

    def leave(self, count: int = 1) -> None:
        self.waiting -= count


def create_app(llm: LLM, model_name: str, max_waiting: int) -> FastAPI:
    engine = EngineLoop(llm)
    admission = Admission(max_waiting)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        engine.stop()
        llm.close()

    app = FastAPI(title="nanopaged", lifespan=lifespan)

    @app.get("/health")
    async def health():
        return PlainTextResponse("", status_code=200 if engine.thread.is_alive() else 503)

    @app.get("/metrics")
    async def metrics():
        stats = llm.stats()
        return PlainTextResponse(f"nanopaged_kv_blocks_free {stats.num_free_blocks}\n"
                                 f"nanopaged_kv_blocks_total {stats.num_blocks}\n"
                                 f"nanopaged_requests_waiting {admission.waiting}\n"
                                 f"nanopaged_sequences_running {stats.num_running_seqs}\n"
                                 f"nanopaged_preemptions_total {stats.num_preemptions}\n"
                                 f"nanopaged_generation_tokens_total "
                                 f"{stats.num_generated_tokens}\n")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model",
                                            "created": int(time.time()), "owned_by": "nanopaged"}]}

    @app.post("/v1/completions")
    @app.post("/v1/chat/completions")
    async def serve(request: Request):
        chat = request.url.path.endswith("/chat/completions")
        try:
            body = await request.json()
        except (ValueError, RecursionError):
            return error_response(400, "the request body is not valid JSON (or nests too deep)")
        if not isinstance(body, dict):
            return error_response(400, "the request body must be a JSON object")
        if body.get("model", model_name) != model_name:
            return error_response(404, f"the model {body['model']!r} does not exist; this server "
                                  f"serves {model_name!r}", "model", "model_not_found")
        try:
            prompts = [chat_prompt(body, llm)] if chat else completion_prompts(body)
            params = sampling_params(body, chat)
            include_usage = stream_options(body)
        except ValueError as error:
            return bad_request(error)
        if not admission.enter(len(prompts)):
            return error_response(503, f"more than {max_waiting} requests are waiting; retry later")
        response = Response(request, engine, admission, len(prompts), params, chat, model_name)
        try:
            await response.submit(prompts)
        except ValueError as error:
            return bad_request(error)
        except Exception as error:
            return error_response(500, f"the engine could not take the request: {error}")
        if body.get("stream"):
            return StreamingResponse(response.events(include_usage), media_type="text/event-stream")
        try:
            return await response.whole()
        except RuntimeError as error:
            return error_response(500, str(error))

    return app


class Response:
    """The outputs of one HTTP request's engine requests (one per prompt), as OpenAI's JSON.

    It holds the request's `admission` until each engine request has produced its first output
    or ended, and aborts what is unfinished when the client goes away or anything fails.
    """

    def __init__(self, request: Request, engine: EngineLoop, admission: Admission,
                 num_prompts: int, params: SamplingParams, chat: bool, model_name: str):
        self.request, self.engine, self.admission = request, engine, admission
        self.num_admitted = num_prompts  # still counted as waiting
        self.outbox: asyncio.Queue = asyncio.Queue()
        self.params = params
        self.n, self.top, self.chat, self.model_name = params.n, params.logprobs, chat, model_name
        self.latest: dict[str, RequestOutput] = {}
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        # engine request id -> prompt index
        self.index = {f"{self.id}-{i}": i for i in range(num_prompts)}

    async def submit(self, prompts: list) -> None:
        """Hands every prompt to the engine; on a failure, withdraws them all."""
        futures = [self.engine.submit(request_id, prompt, self.params, self.outbox)
                   for request_id, prompt in zip(self.index, prompts)]
        try:
            for future in futures:
                await asyncio.wrap_future(future)
        except BaseException:
            self._release(set(self.index))
            raise

    def _release(self, unfinished: set[str]) -> None:
        self.admission.leave(self.num_admitted)
        self.num_admitted = 0
        for request_id in unfinished:
            self.engine.abort(request_id)

    async def outputs(self):
        """Yields each output as it comes; aborts what is unfinished if the client goes away."""
        unfinished, checked = set(self.index), time.monotonic()
        try:
            while unfinished:
                try:
                    output = await asyncio.wait_for(self.outbox.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    output = None
                if time.monotonic() - checked >= 0.5:  # whether outputs flow or not
                    if await self.request.is_disconnected():
                        return
                    checked = time.monotonic()
                if output is None:
                    continue
                if isinstance(output, Exception):
                    raise RuntimeError(f"the engine failed: {output}")
                if output.request_id not in self.latest:
                    self.admission.leave()
                    self.num_admitted -= 1
                self.latest[output.request_id] = output
                if output.finished:
                    unfinished.discard(output.request_id)
                if output.error is not None:
                    raise RuntimeError(f"the request failed: {output.error}")
                yield output
        finally:
            self._release(unfinished)

    def choices(self, output: RequestOutput) -> list[tuple[int, object]]:
        return [(self.index[output.request_id] * self.n + c.index, c) for c in output.outputs]

    def envelope(self, choices: list, chunk: bool = False, **extra) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model_name,
                "choices": choices, **extra}

    def usage(self) -> dict:
        prompt_tokens = sum(len(o.prompt_token_ids) for o in self.latest.values())
        completion_tokens = sum(len(c.token_ids) for o in self.latest.values() for c in o.outputs)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    async def whole(self) -> dict:
        async for _ in self.outputs():
            pass
        choices = []
        for output in self.latest.values():
            for index, c in self.choices(output):
                text = {"message": {"role": "assistant", "content": c.text}} if self.chat else {"text": c.text}
                choices.append({"index": index, **text, "logprobs": logprobs_json(c, 0, self.top, self.chat),
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        return self.envelope(sorted(choices, key=lambda c: c["index"]), usage=self.usage())

    async def events(self, include_usage: bool):
        """Server-sent events: a chunk for each choice that got tokens in a step, then the usage
        if asked for, then [DONE]."""
        sent: dict[int, tuple[int, int]] = {}  # choice -> characters and tokens sent
        try:
            async for output in self.outputs():
                for index, c in self.choices(output):
                    chars, tokens = sent.get(index, (0, 0))
                    if tokens == len(c.token_ids):
                        continue  # no new token (another choice of the request advanced)
                    delta = c.text[chars:]  # may be empty: a character still incomplete
                    sent[index] = (len(c.text), len(c.token_ids))
                    if self.chat:
                        body = {"delta": {"role": "assistant", "content": delta} if chars == tokens == 0
                                else {"content": delta} if delta else {}}
                    else:
                        body = {"text": delta}
                    choice = {"index": index, **body, "finish_reason": c.finish_reason,
                              "logprobs": logprobs_json(c, tokens, self.top, self.chat)}
                    yield f"data: {json.dumps(self.envelope([choice], chunk=True))}\n\n"
        except RuntimeError as error:
            body = {"error": {"message": str(error), "type": "server_error", "param": None,
                              "code": None}}
            yield f"data: {json.dumps(body)}\n\n"
            yield "data: [DONE]\n\n"
            return
        if include_usage:
            yield f"data: {json.dumps(self.envelope([], chunk=True, usage=self.usage()))}\n\n"
        yield "data: [DONE]\n\n"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="nanopaged serve", description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a checkpoint directory or a Hugging Face id")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-waiting", type=int, default=256,
                        help="requests that may wait for their first token; more get 503 at once")
    parser.add_argument("--served-model-name", help="the model's name in the API (default: MODEL)")
    parser.add_argument("--log-level", default="info", help="uvicorn's: warning hides each request")
    for f in fields(Config):  # every engine option, e.g. --max-model-len
        if f.init and f.name != "model":
            kind = next(t for t in get_args(f.type) or (f.type,) if t is not type(None))
            flag = "--" + f.name.replace("_", "-")
            if kind is bool:
                parser.add_argument(flag, action="store_const", const=True, dest=f.name)
            else:
                parser.add_argument(flag, type=str if kind is torch.dtype else kind, dest=f.name)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv[1:] if argv[:1] == ["serve"] else argv)
    options = {f.name: getattr(args, f.name) for f in fields(Config)
               if f.init and f.name != "model" and getattr(args, f.name) is not None}
    llm = LLM(args.model, **options)
    app = create_app(llm, args.served_model_name or args.model, args.max_waiting)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=3)


if __name__ == "__main__":
    main()
