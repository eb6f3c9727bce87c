"""OpenAI's responses for the server: the engine requests of one HTTP request (one per
prompt) and their outputs as they come, turned into OpenAI's JSON, whole or as
server-sent events; chat completions carry tool calls (see `tool_calls.py`); and the
errors, in OpenAI's shape."""

import asyncio
import json
import re
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse

from nanopaged.engine.compat import EnginePaused
from nanopaged.outputs import CompletionOutput, Logprob, RequestOutput
from nanopaged.serving import tool_calls
from nanopaged.serving.openai_api import ParsedRequest

LOGPROB_FLOOR = -9999.0  # what vLLM reports for -inf: JSON has no infinities


class EndedByServer(RuntimeError):
    """What the requests still running get when the server ends them (it shuts down,
    or its engine is put to sleep): not a failure of theirs, nor of the engine (an HTTP
    503, or a stream's last error event)."""


class Response:
    """One HTTP request's engine requests and their outputs. It holds its place among
    the waiting requests until each engine request has produced a first output or ended,
    and aborts what is unfinished when the client goes away or anything fails."""

    def __init__(
        self,
        request: Request,
        engine,
        parsed: ParsedRequest,
        chat: bool,
        model_name: str,
        lora_request=None,
    ):
        self.request, self.engine, self.parsed = request, engine, parsed
        self.chat, self.model_name, self.num_admitted = chat, model_name, 0
        self.lora_request = lora_request  # the adapter `model_name` names, or None
        self.client_gone = False  # the client went away: the outputs stopped early
        self.decode = engine.llm.tokenizer.decode
        self.outbox: asyncio.Queue = asyncio.Queue()
        self.latest: dict[str, RequestOutput] = {}
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        # engine request id -> prompt index
        self.index = {f"{self.id}-{i}": i for i in range(len(parsed.prompts))}

    def admit(self) -> bool:
        """Whether its requests may wait for the engine: they fit under `max_waiting`
        beside those waiting, or none waits (so that a larger batch is never refused
        forever)."""
        waiting = self.engine.num_waiting
        if waiting and waiting + len(self.index) > self.engine.max_waiting:
            return False
        self.engine.num_waiting += len(self.index)
        self.num_admitted = len(self.index)
        return True

    async def start(self) -> JSONResponse | None:
        """Hands the request to the engine; the error response if it cannot."""
        if not self.admit():
            return error_response(
                503,
                f"more than {self.engine.max_waiting} requests are waiting; "
                f"retry later",
            )
        try:
            await self.submit()
        except ValueError as error:
            return bad_request(error)
        except EnginePaused as error:  # asleep, or mid-update: later
            return error_response(503, str(error))
        except Exception as error:
            return error_response(
                500, f"the engine could not take the request: {error}"
            )
        return None

    async def answer(self) -> dict | JSONResponse:
        """The whole answer of a request `start` handed on, or an error response."""
        failed = await self.collect()
        if failed is not None:
            return failed
        choices = [
            self._chat_choice(i, c) if self.chat else self._completion_choice(i, o, c)
            for o in self.latest.values()
            for i, c in self._choices(o)
        ]
        return self.envelope(
            sorted(choices, key=lambda c: c["index"]), usage=self._usage()
        )

    async def run(self) -> list[RequestOutput] | JSONResponse:
        """Starts the request and waits for it: each prompt's last output, in order;
        or the error response (a 499 if the client went away)."""
        failed = await self.start()
        if failed is None:
            failed = await self.collect()
        if failed is not None:
            return failed
        if self.client_gone:  # its requests are aborted; nobody reads an answer
            return error_response(499, "the client closed the request")
        return [self.latest[request_id] for request_id in self.index]

    async def collect(self) -> JSONResponse | None:
        """Waits for every output (the last of each request in `latest`); the error
        response if one fails or the server ends them."""
        try:
            async for _ in self.outputs():
                pass
        except EndedByServer as error:
            return error_response(503, str(error))
        except RuntimeError as error:
            return error_response(500, str(error))
        return None

    async def submit(self) -> None:
        """Hands every prompt to the engine; on a failure, withdraws them all."""
        futures = [
            self.engine.submit(
                request_id, prompt, self.parsed.params, self.outbox, self.lora_request
            )
            for request_id, prompt in zip(self.index, self.parsed.prompts)
        ]
        try:
            for future in futures:
                await asyncio.wrap_future(future)
        except BaseException:
            self._release(set(self.index))
            raise

    def _release(self, unfinished: set[str]) -> None:
        self.engine.num_waiting -= self.num_admitted
        self.num_admitted = 0
        for request_id in unfinished:
            self.engine.abort(request_id)

    async def outputs(self):
        """Yields each output as it comes; aborts what is unfinished if the client goes
        away."""
        unfinished, checked = set(self.index), time.monotonic()
        every = 0.1  # seconds between two looks for a client gone: a step or a few
        try:
            while unfinished:
                try:
                    output = await asyncio.wait_for(self.outbox.get(), timeout=every)
                except asyncio.TimeoutError:
                    output = None
                if time.monotonic() - checked >= every:  # whether outputs flow or not
                    if await self.request.is_disconnected():
                        self.client_gone = True
                        return
                    checked = time.monotonic()
                if output is None:
                    continue
                if isinstance(output, EndedByServer):
                    raise output
                if isinstance(output, Exception):
                    raise RuntimeError(f"the engine failed: {output}")
                if output.request_id not in self.latest:
                    self.engine.num_waiting -= 1
                    self.num_admitted -= 1
                self.latest[output.request_id] = output
                if output.finished:
                    unfinished.discard(output.request_id)
                if output.error is not None:
                    raise RuntimeError(f"the request failed: {output.error}")
                yield output
        finally:
            self._release(unfinished)

    def _choices(self, output: RequestOutput) -> list[tuple[int, CompletionOutput]]:
        n = len(output.outputs)
        return [
            (self.index[output.request_id] * n + c.index, c) for c in output.outputs
        ]

    def envelope(self, choices: list, chunk: bool = False, **extra) -> dict:
        kind = (
            ("chat.completion.chunk" if chunk else "chat.completion")
            if self.chat
            else "text_completion"
        )
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model_name,
            "choices": choices,
            **extra,
        }

    def _usage(self) -> dict:
        prompt_tokens = sum(len(o.prompt_token_ids) for o in self.latest.values())
        completion_tokens = sum(
            len(c.token_ids) for o in self.latest.values() for c in o.outputs
        )
        cached_tokens = sum(o.num_cached_tokens for o in self.latest.values())
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens},
        }

    def _completion_choice(
        self, index: int, output: RequestOutput, completion: CompletionOutput
    ) -> dict:
        """With echo, the prompt (and its logprobs) comes first."""
        text, token_ids, logprobs = (
            completion.text,
            completion.token_ids,
            completion.logprobs,
        )
        if self.parsed.echo_only:
            text, token_ids, logprobs = "", [], [] if logprobs is not None else None
        if self.parsed.echo:
            text = (output.prompt or "") + text
            token_ids = output.prompt_token_ids + token_ids
            logprobs = None if logprobs is None else output.prompt_logprobs + logprobs
        return {
            "index": index,
            "text": text,
            "finish_reason": self._finish(completion),
            "stop_reason": completion.stop_reason,
            "logprobs": None
            if logprobs is None
            else completion_logprobs(
                logprobs, token_ids, self.parsed.params.logprobs, 0, self.decode
            ),
            "prompt_logprobs": prompt_logprobs(output.prompt_logprobs),
        }

    def _chat_choice(self, index: int, completion: CompletionOutput) -> dict:
        content, calls = tool_calls.parse(completion.text, *self.parsed.tool_choice)
        message = {
            "role": "assistant",
            "content": content,
            **({"tool_calls": calls} if calls else {}),
        }
        logprobs = completion.logprobs and chat_logprobs(
            completion, 0, self.parsed.params.logprobs
        )
        return {
            "index": index,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": self._finish(completion, bool(calls)),
            "stop_reason": completion.stop_reason,
        }

    def _finish(self, completion: CompletionOutput, called: bool = False) -> str | None:
        if completion.finish_reason is None:
            return None
        if self.parsed.echo_only:
            return "length"
        forced_call = self.parsed.tool_choice[0] in ("auto", "required")
        return "tool_calls" if called and forced_call else completion.finish_reason

    async def events(self):
        """Server-sent events: chunks for each choice that got tokens in a step (with
        echo, the prompt first), then the usage if asked for, then [DONE]; an error ends
        the stream with an error event and [DONE]."""
        sent: dict[int, tuple[int, int]] = {}  # choice -> characters and tokens sent
        streams: dict[int, tool_calls.ToolCallStream] = {}
        try:
            async for output in self.outputs():
                for index, c in self._choices(output):
                    chars, tokens = sent.get(index, (0, 0))
                    if tokens == len(c.token_ids):
                        continue  # no new token (another choice advanced)
                    if self.chat:
                        stream = streams.setdefault(
                            index, tool_calls.ToolCallStream(*self.parsed.tool_choice)
                        )
                        choices = self._chat_chunks(index, c, tokens, stream)
                    else:
                        choices = [
                            self._completion_chunk(index, output, c, chars, tokens)
                        ]
                    sent[index] = (len(c.text), len(c.token_ids))
                    for choice in choices:
                        chunk = self.envelope([choice], chunk=True)
                        yield f"data: {json.dumps(chunk)}\n\n"
        except RuntimeError as error:
            body = {
                "error": {
                    "message": str(error),
                    "type": "server_error",
                    "param": None,
                    "code": None,
                }
            }
            yield f"data: {json.dumps(body)}\n\n"
        else:
            if self.parsed.include_usage:
                usage = self._usage()
                chunk = self.envelope([], chunk=True, usage=usage)
                yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"

    def _completion_chunk(
        self,
        index: int,
        output: RequestOutput,
        completion: CompletionOutput,
        chars: int,
        tokens: int,
    ) -> dict:
        """What `completion` added since `chars` characters and `tokens` tokens (may be
        empty: a character still incomplete); with echo, the prompt before the first."""
        echo = (output.prompt or "") if self.parsed.echo and tokens == 0 else ""
        logprobs = completion.logprobs and completion_logprobs(
            completion.logprobs[tokens:],
            completion.token_ids[tokens:],
            self.parsed.params.logprobs,
            chars,
            self.decode,
        )
        return {
            "index": index,
            "text": echo + completion.text[chars:],
            "logprobs": logprobs,
            "finish_reason": self._finish(completion),
            **(
                {"prompt_logprobs": prompt_logprobs(output.prompt_logprobs)}
                if tokens == 0
                else {}
            ),
        }

    def _chat_chunks(
        self,
        index: int,
        completion: CompletionOutput,
        tokens: int,
        stream: tool_calls.ToolCallStream,
    ) -> list[dict]:
        """The deltas of a step: content, or tool calls as they become known (one chunk
        even when the text has not grown, so that a client sees every step)."""
        finished = completion.finish_reason is not None
        deltas = stream.deltas(completion.text, finished) or [{}]
        if tokens == 0:
            deltas[0] = {"role": "assistant", **deltas[0]}
        logprobs = completion.logprobs and chat_logprobs(
            completion, tokens, self.parsed.params.logprobs
        )
        chunks = [
            {
                "index": index,
                "delta": delta,
                "logprobs": logprobs if i == 0 else None,
                "finish_reason": None,
            }
            for i, delta in enumerate(deltas)
        ]
        chunks[-1]["finish_reason"] = self._finish(completion, bool(stream.calls))
        return chunks


def completion_logprobs(
    entries: list[dict[int, Logprob] | None],
    token_ids: list[int],
    top: int,
    text_offset: int,
    decode,
) -> dict:
    """The completions format: each token's text, logprob, the `top` most likely tokens
    (and the token itself) by text, and where its text starts (None logprobs for the
    prompt's first token)."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, entries):
        text = entry[token_id].decoded_token if entry else decode([token_id])
        tokens.append(text)
        token_logprobs.append(entry and max(entry[token_id].logprob, LOGPROB_FLOOR))
        top_logprobs.append(
            entry
            and {
                lp.decoded_token: max(lp.logprob, LOGPROB_FLOOR)
                for t, lp in entry.items()
                if t == token_id or lp.rank <= top
            }
        )
        offsets.append(text_offset)
        text_offset += len(text or "")
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


def prompt_logprobs(entries: list[dict[int, Logprob] | None] | None) -> list | None:
    """vLLM's `prompt_logprobs`: per prompt token (None for the first), the logprob,
    rank and text of the token and of the most likely ones, by token id."""
    if entries is None:
        return None
    return [
        entry
        and {
            str(t): {
                "logprob": max(lp.logprob, LOGPROB_FLOOR),
                "rank": lp.rank,
                "decoded_token": lp.decoded_token,
            }
            for t, lp in entry.items()
        }
        for entry in entries
    ]


def chat_logprobs(completion: CompletionOutput, start: int, top: int) -> dict:
    """The chat format of the logprobs of a completion's tokens from `start` on."""

    def item(lp: Logprob) -> dict:
        return {
            "token": lp.decoded_token,
            "logprob": max(lp.logprob, LOGPROB_FLOOR),
            "bytes": list(lp.decoded_token.encode()),
        }

    pairs = zip(completion.token_ids[start:], completion.logprobs[start:])
    return {
        "content": [
            dict(
                item(entry[t]),
                top_logprobs=[item(lp) for lp in entry.values() if lp.rank <= top][
                    :top
                ],
            )
            for t, entry in pairs
        ]
    }


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    kind = (
        ("invalid_request_error" if status < 500 else "server_error")
        if status != 404
        else "NotFoundError"
    )
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": param, "code": code}},
        status_code=status,
    )


def bad_request(error: ValueError) -> JSONResponse:
    message = str(error)
    # messages name the field
    field = re.match(r"(\w+)(:| must| is not supported)", message)
    param = "messages" if message.startswith("message ") else field and field.group(1)
    return error_response(400, message, param)


async def read_body(request: Request) -> dict | JSONResponse:
    try:
        body = await request.json()
    except (ValueError, RecursionError):
        return error_response(
            400, "the request body is not valid JSON (or nests too deep)"
        )
    if not isinstance(body, dict):
        return error_response(400, "the request body must be a JSON object")
    return body
