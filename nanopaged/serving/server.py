"""An OpenAI-compatible HTTP server: `nanopaged serve MODEL`, `python -m
nanopaged.serving.server MODEL`, or vLLM's `python -m
nanopaged.entrypoints.openai.api_server --model MODEL` (the arguments: `args.py`).

One engine loop runs in a thread of its own and is the only caller of the engine:
handlers hand it requests and aborts through a queue, and after every step it hands each
request's outputs to the handler waiting for them. The engine admits a request that
arrives while others decode at its next step. Requests are read in `openai_api.py`,
responses written in `openai_responses.py`. Needs the `serve` extra: pip install -e
".[serve]".
"""

import argparse
import asyncio
import dataclasses
import queue
import socket
import sys
import threading
import time
from concurrent.futures import Future
from contextlib import asynccontextmanager
from importlib.metadata import version

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from nanopaged import LLM, chat, envs
from nanopaged.checkpoint import is_multimodal
from nanopaged.engine.arg_utils import EngineArgs
from nanopaged.engine.data_parallel import ReplicaDied, sum_stats
from nanopaged.lora.request import LoRARequest
from nanopaged.outputs import EngineStats
from nanopaged.serving import openai_api
from nanopaged.serving.args import parse_args
from nanopaged.serving.openai_responses import (
    EndedByServer,
    Response,
    bad_request,
    error_response,
    read_body,
)
from nanopaged.serving.router import Router
from nanopaged.serving.served_models import ServedModels


class EngineLoop:
    """Runs the engine's steps in a thread of its own; sleeps while there is nothing to
    do. It also counts the requests that wait for their first token (`num_waiting`), so
    that those beyond `max_waiting` are turned away (503) rather than queued without
    bound."""

    def __init__(self, llm: LLM, max_waiting: int):
        self.llm, self.max_waiting, self.num_waiting = llm, max_waiting, 0
        # (function, args) to run on the loop
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.outboxes: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.running, self.dead = True, False  # dead: its replica's process died
        self.thread = threading.Thread(
            target=self._run, name="nanopaged-engine", daemon=True
        )
        self.thread.start()

    def submit(
        self,
        request_id: str,
        prompt: dict,
        params,
        outbox: asyncio.Queue,
        lora_request=None,
    ) -> Future:
        """Queues a request; the future is done once the engine took it, or holds the
        error (a ValueError: the client's fault) that rejected it. Its outputs, and an
        exception if a step fails, will be put in `outbox`."""
        future: Future = Future()
        loop = asyncio.get_running_loop()
        self.inbox.put(
            (
                self._add,
                (request_id, prompt, params, lora_request, loop, outbox, future),
            )
        )
        return future

    def call(self, method: str, *args) -> Future:
        """Runs the engine's `method` on the loop (the engine's only caller); the future
        holds what it returns or raises."""
        future: Future = Future()
        self.inbox.put((self._call, (getattr(self.llm, method), args, future)))
        return future

    def abort(self, request_id: str) -> None:
        self.inbox.put((self._abort, (request_id,)))

    def fail_all(self, reason: str) -> None:
        """Ends every request with an error (the server is shutting down, or its engine
        is put to sleep)."""
        self.inbox.put((self._fail_all, (EndedByServer(reason),)))

    def stop(self) -> None:
        self.running = False
        self.inbox.put((lambda: None, ()))
        self.thread.join()

    def is_alive(self) -> bool:
        return self.thread.is_alive() and not self.dead

    def _add(
        self,
        request_id: str,
        prompt,
        params,
        lora_request,
        loop,
        outbox,
        future: Future,
    ) -> None:
        if self._call(
            self.llm.add_request, (prompt, params, request_id, lora_request), future
        ):
            self.outboxes[request_id] = (loop, outbox)

    @staticmethod
    def _call(function, args: tuple, future: Future) -> bool:
        try:
            future.set_result(function(*args))
        # a ValueError is the client's fault; the loop goes on
        except Exception as error:
            future.set_exception(error)
            return False
        return True

    def _abort(self, request_id: str) -> None:
        self.llm.abort(request_id)
        self.outboxes.pop(request_id, None)

    def _fail_all(self, error: Exception) -> None:
        for request_id, (loop, outbox) in list(self.outboxes.items()):
            loop.call_soon_threadsafe(outbox.put_nowait, error)
            # a dead replica has nothing to abort
            if not isinstance(error, ReplicaDied):
                self.llm.abort(request_id)
        self.outboxes.clear()

    def _refuse_all(self) -> None:
        """The loop of a replica whose process died: /health says so and the router
        sends it nothing more, but what it was sent before the router knew is answered
        (the dead replica's error), never left waiting."""
        self.dead = True
        while self.running:
            function, args = self.inbox.get()
            try:
                function(*args)  # a request's future gets the replica's error
            except Exception:
                pass  # an abort: nothing to abort

    def idle(self) -> bool:
        """Nothing to step: no request, or an engine that does not generate now (its
        kept requests wait: asleep, or mid-update)."""
        paused = getattr(self.llm, "paused", None)  # a replica's has none
        return self.llm.is_finished() or (paused is not None and paused() is not None)

    def _run(self) -> None:
        """Serves the inbox and steps the engine until stopped. Nothing a request does
        can end this loop: a failed step fails the requests it held, and the loop goes
        on (a replica whose process died only refuses what it is sent)."""
        while self.running:
            try:
                if self.idle():
                    function, args = self.inbox.get()  # sleep until work arrives
                    function(*args)
                while not self.inbox.empty():
                    function, args = self.inbox.get()
                    function(*args)
                if self.idle():
                    continue
                outputs = self.llm.step()
            # the engine has aborted every request: tell their handlers
            except Exception as error:
                self._fail_all(error)
                if isinstance(error, ReplicaDied):
                    return self._refuse_all()
                continue
            for output in outputs:
                take = self.outboxes.pop if output.finished else self.outboxes.get
                loop, outbox = take(output.request_id)
                loop.call_soon_threadsafe(outbox.put_nowait, output)


def metric_lines(stats: EngineStats, labels: str) -> list[str]:
    return [
        f"nanopaged_{name}{labels} {value}\n"
        for name, value in (
            ("kv_blocks_free", stats.num_free_blocks),
            ("kv_blocks_total", stats.num_blocks),
            ("sequences_running", stats.num_running_seqs),
            ("preemptions_total", stats.num_preemptions),
            ("generation_tokens_total", stats.num_generated_tokens),
            ("spec_decode_num_drafts_total", stats.num_drafts),
            ("spec_decode_num_draft_tokens_total", stats.num_proposed_tokens),
            ("spec_decode_num_accepted_tokens_total", stats.num_accepted_tokens),
        )
    ]


def create_app(
    llm: LLM,
    model_name: str,
    max_waiting: int,
    router: str = "prefix",
    lora_modules: list[LoRARequest] = (),
) -> FastAPI:
    """The app serving `llm` as `model_name`, and each of `lora_modules` (added to the
    engine already) as a model of its adapter's name."""
    # data parallelism: an engine loop per replica
    replicas = getattr(llm, "replicas", None)
    engine = (
        EngineLoop(llm, max_waiting)
        if replicas is None
        else Router(
            llm,
            [EngineLoop(replica, max_waiting) for replica in replicas],
            max_waiting,
            router,
        )
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        engine.stop()
        llm.close()

    app = FastAPI(title="nanopaged", lifespan=lifespan)
    app.state.engine = engine
    pooling = getattr(llm, "runner_type", "generate") == "pooling"
    images = is_multimodal(llm.config.hf_config) and not pooling
    model_card = {
        "id": model_name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "nanopaged",
        "root": llm.config.model,
        "parent": None,
        "max_model_len": llm.config.max_model_len,
        # what a request may bring: text, and images for a vision-language model
        "modalities": ["text", "image"] if images else ["text"],
    }
    models = ServedModels(engine, model_card, lora_modules)
    if pooling:
        from nanopaged.serving.pooling_api import add_pooling_routes

        add_pooling_routes(app, engine, models)
    # vLLM's endpoints, behind vLLM's variables
    if envs.VLLM_ALLOW_RUNTIME_LORA_UPDATING:
        models.add_lora_routes(app)
    if envs.VLLM_SERVER_DEV_MODE and replicas is None:
        from nanopaged.serving.rl_api import add_rl_routes

        add_rl_routes(app, engine)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException):
        return error_response(
            error.status_code,
            f"{request.method} {request.url.path}: {error.detail}",
            code=str(error.status_code),
        )

    @app.get("/health")
    async def health():
        return PlainTextResponse("", status_code=200 if engine.is_alive() else 503)

    @app.get("/version")
    async def server_version():
        return {"version": version("nanopaged")}

    @app.get("/metrics")
    async def metrics():
        """The engine's counters; with replicas, their sums, then each replica's
        (labelled), and how many requests the router sent each, by reason."""
        every = (
            await asyncio.to_thread(llm.replica_stats) if replicas else {0: llm.stats()}
        )
        lines = metric_lines(sum_stats(list(every.values())), "")
        lines.append(f"nanopaged_requests_waiting {engine.num_waiting}\n")
        if replicas is not None:
            for i, stats in every.items():
                lines += metric_lines(stats, f'{{replica="{i}"}}')
                lines += [
                    f"nanopaged_router_requests_total"
                    f'{{replica="{i}",reason="{reason}"}} {count}\n'
                    for reason, count in engine.routed[i].items()
                ]
        return PlainTextResponse("".join(lines))

    @app.get("/v1/models")
    async def list_models():
        return {
            "object": "list",
            "data": [models.card(name) for name in models.names()],
        }

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        return models.card(model) if model in models else models.not_found(model)

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        tokenizer = llm.tokenizer
        return {
            "tokenizer_class": type(tokenizer).__name__,
            "eos_token": tokenizer.eos_token,
            "bos_token": tokenizer.bos_token,
            "pad_token": tokenizer.pad_token,
            "unk_token": tokenizer.unk_token,
            "chat_template": tokenizer.chat_template,
            "model_max_length": llm.config.max_model_len,
        }

    @app.post("/tokenize")
    @app.post("/detokenize")
    async def tokenize(request: Request):
        body = await read_body(request)
        if isinstance(body, JSONResponse):
            return body
        try:
            if request.url.path == "/detokenize":
                return {"prompt": detokenize(llm, body)}
            return tokenize_body(llm, body)
        except ValueError as error:
            return bad_request(error)

    @app.post("/v1/completions")
    @app.post("/v1/chat/completions")
    async def serve(request: Request):
        chat_request = request.url.path.endswith("/chat/completions")
        body = await read_body(request)
        if isinstance(body, JSONResponse):
            return body
        requested = body.get("model", model_name)
        if requested not in models:
            return models.not_found(requested)
        if pooling:
            return bad_request(
                ValueError(
                    f"{requested} is a pooling model: it cannot generate; it serves "
                    "/v1/embeddings, /classify, /score and /rerank"
                )
            )
        try:  # in a worker thread: a grammar or a long prompt never holds up the others
            parsed = await asyncio.to_thread(
                openai_api.parse_request, body, chat_request, llm
            )
        except ValueError as error:
            return bad_request(error)
        return await respond(
            Response(
                request,
                engine,
                parsed,
                chat_request,
                requested,
                models.adapters.get(requested),
            )
        )

    return app


async def respond(response: Response):
    """The response to one request: a stream of events, or the whole answer (a dict),
    or an error response."""
    if response.parsed.beam is not None:
        from nanopaged.serving import beam_api

        return await beam_api.respond(response)
    refused = await response.start()
    if refused is not None:
        return refused
    if response.parsed.stream:
        return StreamingResponse(response.events(), media_type="text/event-stream")
    return await response.answer()


def tokenize_body(llm: LLM, body: dict) -> dict:
    """vLLM's /tokenize: a prompt, or chat messages through the template."""
    if "messages" in body:
        _, tokens, _ = chat.render(
            llm.tokenizer,
            body["messages"],
            body.get("chat_template"),
            body.get("add_generation_prompt", True),
            body.get("continue_final_message", False),
            body.get("tools"),
            body.get("chat_template_kwargs"),
        )
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be a string, got {prompt!r}")
        chat.check_text(prompt, "prompt")
        tokens = llm.tokenizer.encode(
            prompt, add_special_tokens=body.get("add_special_tokens", True)
        )
    result = {
        "count": len(tokens),
        "max_model_len": llm.config.max_model_len,
        "tokens": tokens,
    }
    if body.get("return_token_strs"):
        result["token_strs"] = llm.tokenizer.convert_ids_to_tokens(tokens)
    return result


def detokenize(llm: LLM, body: dict) -> str:
    tokens = body.get("tokens")
    vocab_size = llm.config.hf_config.vocab_size
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and 0 <= t < vocab_size for t in tokens
    ):
        raise ValueError(
            f"tokens must be a list of token ids in [0, {vocab_size}), got {tokens!r}"
        )
    return llm.tokenizer.decode(tokens)


class Server(uvicorn.Server):
    """uvicorn's server, which on SIGTERM or Ctrl-C first ends every stream with an
    error event, so that no stream is cut off mid-way."""

    def handle_exit(self, sig, frame) -> None:
        self.config.app.state.engine.fail_all(
            "the server is shutting down: this request ended before its last token; "
            "send it again once a server runs"
        )
        super().handle_exit(sig, frame)


def check_port_free(host: str, port: int) -> None:
    """Before the model loads (which takes a while): a ValueError if another program
    listens on `port` already (bound as uvicorn binds, so that what it could take
    passes)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as error:
            raise ValueError(
                f"cannot listen on {host}:{port} ({error.strerror}): another server "
                f"holds that port, or the host is not this machine's; choose another "
                f"with --port or --host"
            ) from None


def serve(args: argparse.Namespace) -> None:
    """Runs the server the command line (`args.py`) asked for, until SIGTERM or
    Ctrl-C."""
    loras = [
        LoRARequest(name, i + 1, path, base)
        for i, (name, path, base) in enumerate(args.lora_modules or [])
    ]
    try:
        check_port_free(args.host, args.port)
        llm = LLM(**dataclasses.asdict(EngineArgs.from_cli_args(args)))
        for lora in loras:
            llm.add_lora(lora)
    # a wrong option, model or adapter: one line, no traceback
    except ValueError as error:
        sys.exit(f"nanopaged serve: error: {error}")
    app = create_app(
        llm, args.served_model_name or args.model, args.max_waiting, args.router, loras
    )
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=3,
    )
    Server(config).run()


def main(argv: list[str] | None = None) -> None:
    """`python -m nanopaged.serving.server MODEL [options]`; Ctrl-C, a line (as
    `nanopaged serve`)."""
    try:
        serve(parse_args(sys.argv[1:] if argv is None else argv))
    except KeyboardInterrupt:
        sys.exit("interrupted")


if __name__ == "__main__":
    main()
