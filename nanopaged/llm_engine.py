"""The engine loop: requests in, schedule a step, run it, apply what it sampled, outputs out."""
import time
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

from tqdm.auto import tqdm

from nanopaged import chat
from nanopaged.block_manager import BlockManager
from nanopaged.compat import VLLMEngineAPI, generation_defaults, normalize_options
from nanopaged.config import Config
from nanopaged.inputs import InputProcessor, Prompt, as_batch, eos_token_ids, load_tokenizer
from nanopaged.model_runner import ModelRunner
from nanopaged.outputs import Request, RequestOutput
from nanopaged.sampler import SamplerOutput, TokenLogprobs
from nanopaged.sampling_params import SamplingParams
from nanopaged.scheduler import ScheduledStep, Scheduler
from nanopaged.sequence import Sequence


@dataclass
class EngineStats:
    """A snapshot of the engine's load: what `/metrics` serves."""
    num_unfinished_requests: int
    num_waiting_seqs: int  # not yet prefilled, or preempted
    num_running_seqs: int
    num_free_blocks: int
    num_blocks: int
    num_preemptions: int
    num_generated_tokens: int
    num_drafts: int  # speculative decoding: rows that verified proposals, how many, accepted
    num_proposed_tokens: int
    num_accepted_tokens: int


class LLMEngine(VLLMEngineAPI):
    """The engine: `LLM(model, **config).generate(prompts, params)`, as in vLLM.

    Requests can also be run a step at a time: `add_request`, then `step()` until
    `is_finished()`; each step returns the outputs of the requests that advanced in it.
    `generate`, `chat` and `stream` refuse to start while such requests are unfinished (their
    outputs would be lost). Every request is checked before anything is queued: bad input is a
    ValueError and leaves the engine as it was. A step that raises (an error, Ctrl-C) aborts
    every unfinished request; the prefix cache keeps only K/V that was written. A failure in one
    request's own bookkeeping (its text, its stop strings) ends that request alone, with its
    `error` set.
    """

    def __new__(cls, model: str, **options):
        size = options.get("data_parallel_size")
        if isinstance(size, int) and not isinstance(size, bool) and size > 1:
            from nanopaged.data_parallel import DataParallelLLM
            return DataParallelLLM(model, **options)
        return super().__new__(cls)

    def __init__(self, model: str, **options):
        self.config = Config.from_options(model, **normalize_options(options))
        self.tokenizer = load_tokenizer(self.config.tokenizer)
        self.eos_token_ids = eos_token_ids(self.config, self.tokenizer)
        # the sampling settings of requests that bring none, as vLLM (checked now)
        self.default_sampling = generation_defaults(self.config)
        SamplingParams(**self.default_sampling)
        self.model_runner = ModelRunner(self.config)
        # tensor-parallel workers exit when the engine is closed or garbage-collected
        self._finalizer = weakref.finalize(self, self.model_runner.close)
        self.block_manager = BlockManager(self.model_runner.num_kvcache_blocks,
                                          self.config.kvcache_block_size,
                                          self.config.enable_prefix_caching)
        self.scheduler = Scheduler(self.config, self.block_manager)
        self._grammars = None
        self.inputs = InputProcessor(self.config, self.tokenizer, self.block_manager.num_blocks,
                                     self.eos_token_ids, self.default_sampling, self.grammars)
        self.requests: dict[str, Request] = {}  # the unfinished ones
        self.num_generated_tokens = 0
        self.num_drafts = self.num_proposed_tokens = self.num_accepted_tokens = 0

    # ---- requests in ----

    def add_request(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queues one request (after checking it); returns its id. vLLM's order of arguments,
        `add_request(request_id, prompt, params)`, works too."""
        self._check_open()
        if not isinstance(sampling_params, (SamplingParams, type(None))):  # vLLM's order
            request_id, prompt, sampling_params = prompt, sampling_params, request_id
        return self._enqueue(self._make_request(prompt, sampling_params, request_id))

    def _make_request(self, prompt: Prompt, params: SamplingParams | None,
                      request_id: str | None = None) -> Request:
        return self.inputs.make_request(prompt, params, request_id, self.requests)

    def _enqueue(self, request: Request) -> str:
        self.requests[request.request_id] = request
        self.scheduler.add(request.seqs[0])  # its other samples fork from it once it is prefilled
        return request.request_id

    def abort(self, request_id: str) -> None:
        """Drops a request and frees its blocks; an unknown or finished id is ignored."""
        request = self.requests.get(request_id)
        if request is not None:
            self.scheduler.abort(request.seqs)
            del self.requests[request_id]

    # ---- steps ----

    def step(self) -> list[RequestOutput]:
        """Runs one step; returns an output (cumulative so far) for every request that got
        tokens in it, `finished` on its last. Returns [] when nothing is queued."""
        return [self._output(request) for request in self.run_step()[1]]

    def run_step(self) -> tuple[ScheduledStep, list[Request]]:
        """`step()` without the outputs: schedules a step, runs it and applies what it sampled;
        returns the step and the requests that got tokens in it. `generate` loops on this."""
        self._check_open()
        try:
            step = self.scheduler.schedule()
            if not step.seqs:
                assert self.scheduler.is_finished(), "requests are queued but none can run"
                return step, []
            sampled = self.model_runner.run(step)
            self.block_manager.commit()  # the step's K/V is written: its hashes may be served
            return step, self._apply(step, sampled)
        except BaseException:
            self._abort_all()
            raise

    def _apply(self, step: ScheduledStep, sampled: SamplerOutput) -> list[Request]:
        """Appends each sampling row's tokens to its sequence, deciding after each token whether
        the sequence stops; finished sequences leave the scheduler with their blocks freed.
        Returns the requests that got tokens, in the order of their first row."""
        now, advanced = time.perf_counter(), {}
        for i, logprobs in sampled.prompt_logprobs.items():
            request = self.requests[step.seqs[i].request_id]
            try:
                request.record_prompt_logprobs(step.starts[i] + 1, logprobs)
            except Exception as error:
                self._fail(request, error)
        for seq, token_ids, logprobs in zip(step.samplers, sampled.token_ids, sampled.logprobs):
            request = advanced[seq.request_id] = self.requests[seq.request_id]
            if seq.finish_reason is not None:  # its request failed earlier in this step
                continue
            try:
                self._append(request, seq, token_ids, logprobs, now)
            except Exception as error:  # one request's own failure ends it alone
                self._fail(request, error)
        for i in step.lookahead_slots:  # keep the accepted proposals' K/V, free the other slots
            if step.seqs[i].finish_reason is None:
                self.block_manager.trim(step.seqs[i])
        if sampled.num_proposed:
            self.num_drafts += sum(map(bool, sampled.num_proposed))
            self.num_proposed_tokens += sum(sampled.num_proposed)
            self.num_accepted_tokens += sum(map(len, sampled.token_ids)) - len(step.samplers)
        return list(advanced.values())

    def _append(self, request: Request, seq: Sequence, token_ids: list[int],
                logprobs: list[TokenLogprobs] | None, now: float) -> None:
        if request.metrics.first_token_time is None:
            request.metrics.first_token_time = now
        for i, token_id in enumerate(token_ids):
            seq.token_ids.append(token_id)
            self.num_generated_tokens += 1
            if seq.grammar is not None:
                seq.grammar.accept(token_id)
            if logprobs is not None:
                request.record_logprobs(seq, logprobs[i])
            stop = self._stop(request, seq)
            if stop is not None:
                self.scheduler.finish(seq, *stop)
                if request.finished:
                    request.metrics.finish_time = now
                return  # tokens after a stop are dropped

    def _stop(self, request: Request, seq: Sequence) -> tuple[str, int | str | None] | None:
        """Whether `seq` stops at its last token, and why, decided in vLLM's order: not before
        min_tokens, then EOS and the stop token ids, stop strings, max_model_len, max_tokens."""
        params, last = seq.sampling_params, seq.token_ids[-1]
        num_completion_tokens = len(seq.token_ids) - seq.num_prompt_tokens
        if last in seq.stop_token_ids and num_completion_tokens >= params.min_tokens:
            return "stop", last if last in (params.stop_token_ids or ()) else None
        if request.detokenizers[seq.index].stop_strings:  # these need the text at every token
            stop_string = request.detokenizers[seq.index].update(seq)  # None before min_tokens
            if stop_string is not None:
                return "stop", stop_string
        if (num_completion_tokens == params.max_tokens
                or len(seq.token_ids) >= self.config.max_model_len):
            return "length", None
        return None

    def _fail(self, request: Request, error: Exception) -> None:
        request.error = f"{type(error).__name__}: {error}"
        request.metrics.finish_time = time.perf_counter()
        self.scheduler.abort(request.seqs)

    def _output(self, request: Request) -> RequestOutput:
        """The request's output so far; a finished request leaves the engine with it."""
        try:
            output = request.output()
        except Exception as error:
            self._fail(request, error)
            output = request.output(with_text=False)
        if output.finished:
            self.requests.pop(request.request_id, None)
        return output

    def is_finished(self) -> bool:
        return self.scheduler.is_finished()

    def grammars(self):
        """The structured outputs' grammars (built on the first request that asks for one)."""
        if self._grammars is None:
            try:
                from nanopaged.structured_outputs import Grammars
            except ImportError:
                raise ValueError("structured outputs need llguidance: pip install "
                                 "'nanopaged[structured]'") from None
            self._grammars = Grammars(self.tokenizer, self.config.hf_config.vocab_size,
                                      self.eos_token_ids,
                                      self.config.structured_outputs_config or {})
        return self._grammars

    def stats(self) -> EngineStats:
        scheduler, pool = self.scheduler, self.block_manager
        return EngineStats(len(self.requests), len(scheduler.waiting), len(scheduler.running),
                           pool.num_free_blocks, pool.num_blocks, scheduler.num_preemptions,
                           self.num_generated_tokens, self.num_drafts,
                           self.num_proposed_tokens, self.num_accepted_tokens)

    def _abort_all(self) -> None:
        """After a failed or interrupted step: nothing half-run stays behind."""
        self.block_manager.rollback()
        for request_id in list(self.requests):
            self.abort(request_id)
        self.block_manager.reclaim()

    # ---- whole batches ----

    def generate(self, prompts: Prompt | list[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generates the completions of every prompt; returns one output per prompt, in order."""
        self._check_idle("generate")
        prompts, sampling_params = as_batch(prompts, sampling_params)
        requests = [self._make_request(p, sp) for p, sp in zip(prompts, sampling_params)]
        try:
            for request in requests:
                self._enqueue(request)
            self._run(len(requests), use_tqdm)
            outputs = [self._output(request) for request in requests]
        finally:
            if self.requests:  # interrupted: no request of this call may stay behind
                self._abort_all()
        for output in outputs:
            if output.error is not None:
                warnings.warn(f"request {output.request_id} failed: {output.error}")
        return outputs

    def _run(self, num_requests: int, use_tqdm: bool) -> None:
        bar = tqdm(total=num_requests, desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        rates = {"prefill": 0.0, "decode": 0.0}
        with bar:
            while not self.is_finished():
                start = time.perf_counter()
                step, advanced = self.run_step()
                seconds = time.perf_counter() - start
                rates["prefill" if step.ragged else "decode"] = step.num_scheduled_tokens / seconds
                bar.set_postfix_str(", ".join(f"{k} {v:,.0f} tok/s" for k, v in rates.items()),
                                    refresh=False)  # update() redraws, at most every 0.1 s
                bar.update(sum(request.finished for request in advanced))

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: list[dict] | None = None, chat_template_kwargs: dict | None = None,
             chat_template_content_format: str = "auto") -> list[RequestOutput]:
        """`generate` for one conversation (a list of messages, see `chat.render`) or a list of
        them, each rendered by the chat template, as vLLM's `LLM.chat`; each output's `prompt`
        is the rendered text. Content parts render as a string ("auto" and "string" formats)."""
        if chat_template_content_format not in ("auto", "string"):
            raise ValueError(f"chat_template_content_format={chat_template_content_format!r} is "
                             f"not supported: text parts always render as one string")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conversation in conversations if isinstance(conversations, list) else [None]:
            text, token_ids = chat.render(self.tokenizer, conversation, chat_template,
                                          add_generation_prompt, continue_final_message, tools,
                                          chat_template_kwargs)
            prompts.append({"prompt": text, "prompt_token_ids": token_ids})
        return self.generate(prompts, sampling_params, use_tqdm)

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None
               ) -> Iterator[str]:
        """Yields the text of one completion as it grows: `for delta in llm.stream(prompt):`.
        Leaving the loop early aborts the request."""
        self._check_idle("stream")
        if sampling_params is not None and getattr(sampling_params, "n", 1) != 1:
            raise ValueError("stream() follows one completion; for n > 1 use add_request() "
                             "and step()")
        request = self._make_request(prompt, sampling_params)
        shown = 0
        try:
            self._enqueue(request)
            while request.request_id in self.requests:
                for output in self.step():
                    text = output.outputs[0].text
                    if text[shown:]:
                        yield text[shown:]
                    shown = len(text)
        finally:
            if self.requests:  # left early, or interrupted
                self._abort_all()

    # ---- life ----

    def _check_open(self) -> None:
        if not self._finalizer.alive:
            raise RuntimeError("the engine is closed; create a new one")

    def _check_idle(self, method: str) -> None:
        self._check_open()
        if self.requests:
            raise ValueError(f"{len(self.requests)} requests added with add_request() are "
                             f"unfinished; run step() until is_finished() or abort() them "
                             f"before {method}()")

    def close(self) -> None:
        """Stops the tensor-parallel worker processes, if any. The engine is unusable after."""
        self._finalizer()

    def __enter__(self) -> "LLMEngine":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class LLM(LLMEngine):
    """The user-facing engine, named as in vLLM."""


