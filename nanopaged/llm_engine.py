"""The engine loop: requests in, schedule a step, run it, record the tokens, outputs out."""
import itertools
import os
import time
import weakref
from collections.abc import Iterator

import numpy as np
from tqdm.auto import tqdm
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from nanopaged.block_manager import BlockManager
from nanopaged.config import Config
from nanopaged.model_runner import ModelRunner
from nanopaged.outputs import Request, RequestOutput
from nanopaged.sampling_params import SamplingParams
from nanopaged.scheduler import Scheduler
from nanopaged.sequence import Sequence

# A text, token ids, or vLLM's {"prompt": text} / {"prompt_token_ids": ids}.
Prompt = str | list[int] | dict
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


class LLMEngine:
    """The engine: `LLM(model, **config).generate(prompts, params)`, as in vLLM.

    Requests can also be run a step at a time: `add_request`, then `step()` until
    `is_finished()`; each step returns the outputs of the requests that advanced in it.
    `generate`, `chat` and `stream` refuse to start while such requests are unfinished (their
    outputs would be lost). Every request is checked before anything is queued: bad input is a
    ValueError and leaves the engine as it was. A step that raises (an error, Ctrl-C) aborts
    every unfinished request; the prefix cache keeps only K/V that was written.
    """

    def __init__(self, model: str, **options):
        self.config = Config.from_options(model, **options)
        self.tokenizer = _load_tokenizer(self.config.model)
        eos = self.tokenizer.eos_token_id
        self.eos_token_ids = self.config.eos_token_ids or frozenset([] if eos is None else [eos])
        self.model_runner = ModelRunner(self.config)
        # tensor-parallel workers exit when the engine is closed or garbage-collected
        self._finalizer = weakref.finalize(self, self.model_runner.close)
        self.block_manager = BlockManager(self.model_runner.num_kvcache_blocks,
                                          self.config.kvcache_block_size)
        self.scheduler = Scheduler(self.config, self.block_manager)
        self.requests: dict[str, Request] = {}  # the unfinished ones
        self._request_ids = itertools.count()

    # ---- requests in ----

    def add_request(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queues one request (after checking it); returns its id."""
        self._check_open()
        request = self._make_request(prompt, sampling_params, request_id)
        self.requests[request.request_id] = request
        self.scheduler.add(request.seqs[0])  # its other samples fork from it once it is prefilled
        return request.request_id

    def _make_request(self, prompt: Prompt, params: SamplingParams | None,
                      request_id: str | None = None) -> Request:
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        params.validate()
        text, token_ids = self._tokenize(prompt)
        config, vocab_size = self.config, self.config.hf_config.vocab_size
        if len(token_ids) >= config.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens; it must be shorter than "
                             f"max_model_len={config.max_model_len}")
        longest = min(len(token_ids) + (params.max_tokens or config.max_model_len), config.max_model_len)
        blocks_needed = -(-longest // config.kvcache_block_size)
        if blocks_needed > self.block_manager.num_blocks:
            raise ValueError(f"request needs up to {blocks_needed} KV-cache blocks ({longest} tokens) "
                             f"but the pool has only {self.block_manager.num_blocks}; lower "
                             f"max_tokens or give the cache more memory")
        if params.n > config.max_num_seqs:
            raise ValueError(f"n={params.n} samples cannot run at once with max_num_seqs={config.max_num_seqs}")
        if any(t >= vocab_size for t in params.stop_token_ids or ()):
            raise ValueError(f"stop_token_ids {params.stop_token_ids} reach outside the vocabulary [0, {vocab_size})")
        request_id = str(next(self._request_ids)) if request_id is None else request_id
        if not isinstance(request_id, str) or request_id in self.requests:
            raise ValueError(f"request_id must be a string not in use, got {request_id!r}")
        stop_token_ids = frozenset(params.stop_token_ids or ()) | (
            frozenset() if params.ignore_eos else self.eos_token_ids)
        seqs = [Sequence(token_ids, params, config.kvcache_block_size, stop_token_ids, request_id, i)
                for i in range(params.n)]
        seqs[0].forks = seqs[1:]
        return Request(request_id, text, token_ids, params, seqs, self.tokenizer)

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if set(prompt) not in ({"prompt"}, {"prompt_token_ids"}):
                raise ValueError(f"a prompt dict takes the key 'prompt' (a text) or 'prompt_token_ids', "
                                 f"as vLLM's TextPrompt and TokensPrompt; got keys {sorted(prompt)}")
            prompt = next(iter(prompt.values()))
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            text, token_ids = None, [_token_id(t) for t in prompt]
        else:
            raise ValueError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not token_ids:
            raise ValueError("prompt is empty")
        vocab_size = self.config.hf_config.vocab_size
        outside = next((t for t in token_ids if not 0 <= t < vocab_size), None)
        if outside is not None:
            raise ValueError(f"token id {outside} is outside the vocabulary [0, {vocab_size})"
                             + (": the tokenizer does not match the model" if text is not None else ""))
        return text, token_ids

    def abort(self, request_id: str) -> None:
        """Drops a request and frees its blocks; an unknown or finished id is ignored."""
        request = self.requests.pop(request_id, None)
        if request is not None:
            self.scheduler.abort(request.seqs)
            for seq in request.seqs:
                self.model_runner.sampler.release(seq)

    # ---- steps ----

    def step(self) -> list[RequestOutput]:
        """Runs one step; returns an output (cumulative so far) for every request that got
        tokens in it, `finished` on its last. Returns [] when nothing is queued."""
        self._check_open()
        return [self._output(request) for request in self._step()[0]]

    def _step(self) -> tuple[list[Request], int, bool]:
        """Returns the requests that advanced, the number of tokens run, and whether any was a
        prompt token."""
        try:
            seqs, is_prefill = self.scheduler.schedule()
            if not seqs:
                assert self.is_finished(), "requests are queued but none can be scheduled"
                return [], 0, False
            tokens, logprobs = self.model_runner.run(seqs, is_prefill, self.block_manager.block_copies)
            self.block_manager.commit()
            advanced = {}
            now = time.perf_counter()
            for seq, seq_logprobs in zip(self.scheduler.postprocess(seqs, tokens), logprobs):
                request = advanced[seq.request_id] = self.requests[seq.request_id]
                stop = request.record(seq, seq_logprobs, now)
                if stop is not None:
                    self.scheduler.finish(seq, "stop", stop)
                if seq.finish_reason is not None:
                    self.model_runner.sampler.release(seq)
                    if request.finished:
                        request.metrics.finish_time = now
        except BaseException:
            self._abort_all()
            raise
        num_tokens = sum(seq.num_scheduled_tokens for seq in seqs) if is_prefill else len(seqs)
        return list(advanced.values()), num_tokens, is_prefill

    def _output(self, request: Request) -> RequestOutput:
        if request.finished:
            self.requests.pop(request.request_id, None)
        return request.output()

    def is_finished(self) -> bool:
        return self.scheduler.is_finished()

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
        if isinstance(prompts, (str, dict)) or _is_token_ids(prompts):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}"
                             + (" (pass array.tolist())" if isinstance(prompts, np.ndarray) else ""))
        if not isinstance(sampling_params, (list, tuple)):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(sampling_params)} sampling params")
        requests = [self._make_request(p, sp) for p, sp in zip(prompts, sampling_params)]
        for request in requests:
            self.requests[request.request_id] = request
            self.scheduler.add(request.seqs[0])
        self._run(len(requests), use_tqdm)
        return [self._output(request) for request in requests]

    def _run(self, num_requests: int, use_tqdm: bool) -> None:
        bar = tqdm(total=num_requests, desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        rates = {"prefill": 0.0, "decode": 0.0}
        try:
            while not self.is_finished():
                start = time.perf_counter()
                advanced, num_tokens, is_prefill = self._step()
                rates["prefill" if is_prefill else "decode"] = num_tokens / (time.perf_counter() - start)
                bar.set_postfix_str(", ".join(f"{k} {v:,.0f} tok/s" for k, v in rates.items()),
                                    refresh=False)  # update() redraws, at most every 0.1 s
                bar.update(sum(request.finished for request in advanced))
        finally:
            bar.close()
            if not self.is_finished():  # interrupted between two steps
                self._abort_all()

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None) -> list[RequestOutput]:
        """`generate` for one conversation (a list of {"role", "content"} messages) or a list of
        them, each rendered by the tokenizer's chat template with the generation prompt added."""
        if chat_template is None and not self.tokenizer.chat_template:
            raise ValueError("the checkpoint's tokenizer has no chat template; pass chat_template= "
                             "or format the prompt yourself and call generate()")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt_token_ids": self.tokenizer.apply_chat_template(
            conversation, chat_template=chat_template, add_generation_prompt=True, tokenize=True,
            return_dict=False)} for conversation in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yields the text of one completion as it grows: `for delta in llm.stream(prompt):`.
        Leaving the loop early aborts the request."""
        self._check_idle("stream")
        if sampling_params is not None and getattr(sampling_params, "n", 1) != 1:
            raise ValueError("stream() follows one completion; for n > 1 use add_request() and step()")
        request_id = self.add_request(prompt, sampling_params)
        shown = 0
        try:
            while request_id in self.requests:
                for output in self.step():
                    text = output.outputs[0].text
                    if text[shown:]:
                        yield text[shown:]
                    shown = len(text)
        finally:
            self.abort(request_id)

    # ---- life ----

    def _check_open(self) -> None:
        if not self._finalizer.alive:
            raise RuntimeError("the engine is closed; create a new one")

    def _check_idle(self, method: str) -> None:
        self._check_open()
        if self.requests:
            raise ValueError(f"{len(self.requests)} requests added with add_request() are unfinished; "
                             f"run step() until is_finished() or abort() them before {method}()")

    def close(self) -> None:
        """Stops the tensor-parallel worker processes, if any. The engine is unusable after."""
        self._finalizer()

    def __enter__(self) -> "LLMEngine":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class LLM(LLMEngine):
    """The user-facing engine, named as in vLLM."""


def _load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    # without these, transformers makes an empty tokenizer rather than fail
    if not any(os.path.exists(os.path.join(path, f)) for f in TOKENIZER_FILES):
        raise ValueError(f"cannot load the tokenizer of {path!r}: it has none of {', '.join(TOKENIZER_FILES)}")
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as error:
        raise ValueError(f"cannot load the tokenizer of {path!r}: {error}") from None


def _is_token_ids(prompt) -> bool:
    return isinstance(prompt, (list, tuple)) and len(prompt) > 0 and isinstance(prompt[0], (int, np.integer))


def _token_id(value) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"token ids must be integers, got {value!r} ({type(value).__name__})")
    return int(value)
