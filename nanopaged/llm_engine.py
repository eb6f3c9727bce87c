"""The engine loop: requests in, schedule a step, run it, record the tokens, outputs out."""
import os
import time
import weakref
from dataclasses import dataclass

from tqdm.auto import tqdm
from transformers import AutoTokenizer, GenerationConfig

from nanopaged.block_manager import BlockManager
from nanopaged.config import Config
from nanopaged.model_runner import ModelRunner
from nanopaged.sampling_params import SamplingParams
from nanopaged.scheduler import Scheduler
from nanopaged.sequence import Sequence

Prompt = str | list[int]


@dataclass
class RequestMetrics:
    """Wall-clock times (time.perf_counter) of one request's life."""
    arrival_time: float
    first_token_time: float
    finish_time: float


@dataclass
class RequestOutput:
    """The result of one request. `token_ids` is the completion only (with the stop token, if
    any); `num_cached_tokens` counts prompt tokens served from the prefix cache."""
    request_id: int
    prompt: Prompt
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    num_cached_tokens: int
    metrics: RequestMetrics


class LLMEngine:
    """Offline inference engine: `LLM(model_path, **config).generate(prompts, params)`."""

    def __init__(self, model: str, **kwargs):
        self.config = Config(model, **kwargs)
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.model_runner = ModelRunner(self.config)
        # tensor-parallel workers exit when the engine is closed or garbage-collected
        self._finalizer = weakref.finalize(self, self.model_runner.close)
        self.block_manager = BlockManager(self.model_runner.num_kvcache_blocks,
                                          self.config.kvcache_block_size)
        self.scheduler = Scheduler(self.config, self.block_manager, self._eos_token_ids())
        self.prompts: dict[int, Prompt] = {}
        self.times: dict[int, list[float]] = {}  # seq_id -> [arrival, first token]

    def _eos_token_ids(self) -> set[int]:
        eos = None
        if os.path.exists(os.path.join(self.config.model, "generation_config.json")):
            eos = GenerationConfig.from_pretrained(self.config.model).eos_token_id
        if eos is None:
            eos = getattr(self.config.hf_config, "eos_token_id", None)
        if eos is None:
            eos = self.tokenizer.eos_token_id
        if eos is None:
            return set()
        return set(eos) if isinstance(eos, list) else {eos}

    def _make_sequence(self, prompt: Prompt, sampling_params: SamplingParams) -> Sequence:
        """Validates one request and builds its sequence; raises ValueError naming the problem."""
        if not isinstance(sampling_params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(sampling_params).__name__}")
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            token_ids = list(prompt)
            vocab_size = self.config.hf_config.vocab_size
            for t in token_ids:
                if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
                    raise ValueError(f"token id {t!r} is outside the vocabulary [0, {vocab_size})")
        else:
            raise ValueError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not token_ids:
            raise ValueError("prompt is empty")
        if len(token_ids) >= self.config.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens; it must be shorter than "
                             f"max_model_len={self.config.max_model_len}")
        longest = min(len(token_ids) + sampling_params.max_tokens, self.config.max_model_len)
        blocks_needed = -(-longest // self.config.kvcache_block_size)
        if blocks_needed > self.block_manager.num_blocks:
            raise ValueError(f"request needs up to {blocks_needed} KV-cache blocks ({longest} tokens) "
                             f"but the pool has only {self.block_manager.num_blocks}; lower "
                             f"max_tokens or give the cache more memory")
        return Sequence(token_ids, sampling_params, self.config.kvcache_block_size)

    def add_request(self, prompt: Prompt, sampling_params: SamplingParams) -> int:
        """Queues one request and returns its id."""
        seq = self._make_sequence(prompt, sampling_params)
        self._add(seq, prompt)
        return seq.seq_id

    def _add(self, seq: Sequence, prompt: Prompt) -> None:
        self.prompts[seq.seq_id] = prompt
        self.times[seq.seq_id] = [time.perf_counter(), 0.0]
        self.scheduler.add(seq)

    def step(self) -> list[RequestOutput]:
        """Runs one scheduled step; returns the requests that finished in it."""
        return self._step()[0]

    def _step(self) -> tuple[list[RequestOutput], bool, int]:
        seqs, is_prefill = self.scheduler.schedule()
        num_tokens = sum(seq.num_scheduled_tokens for seq in seqs) if is_prefill else len(seqs)
        token_ids = self.model_runner.run(seqs, is_prefill)
        finished = self.scheduler.postprocess(seqs, token_ids)
        if is_prefill:  # a request's first token comes from the step that ends its prefill
            now = time.perf_counter()
            for seq in seqs:
                times = self.times[seq.seq_id]
                if seq.num_completion_tokens == 1 and not times[1]:
                    times[1] = now
        for seq in finished:
            self.model_runner.sampler.release(seq)
        return [self._output(seq) for seq in finished], is_prefill, num_tokens

    def _output(self, seq: Sequence) -> RequestOutput:
        return RequestOutput(
            request_id=seq.seq_id, prompt=self.prompts.pop(seq.seq_id),
            prompt_token_ids=seq.token_ids[:seq.num_prompt_tokens],
            text=self.tokenizer.decode(seq.completion_token_ids, skip_special_tokens=True),
            token_ids=seq.completion_token_ids, finish_reason=seq.finish_reason,
            num_cached_tokens=seq.num_cached_tokens,
            metrics=RequestMetrics(*self.times.pop(seq.seq_id), time.perf_counter()))

    def is_finished(self) -> bool:
        return self.scheduler.is_finished()

    def close(self) -> None:
        """Stops the tensor-parallel worker processes, if any. The engine is unusable after."""
        self._finalizer()

    def __enter__(self) -> "LLMEngine":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def generate(self, prompts: list[Prompt] | Prompt,
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generates a completion for every prompt; returns outputs in prompt order.

        Every request is validated before any is queued, so a bad one leaves the engine as it was.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if not isinstance(sampling_params, (list, tuple)):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(sampling_params)} sampling params")
        seqs = [self._make_sequence(p, sp) for p, sp in zip(prompts, sampling_params)]
        for seq, prompt in zip(seqs, prompts):
            self._add(seq, prompt)
        outputs: dict[int, RequestOutput] = {}
        bar = tqdm(total=len(seqs), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        rates = {"prefill": 0.0, "decode": 0.0}
        try:
            while not self.is_finished():
                start = time.perf_counter()
                finished, is_prefill, num_tokens = self._step()
                rates["prefill" if is_prefill else "decode"] = num_tokens / (time.perf_counter() - start)
                bar.set_postfix_str(", ".join(f"{k} {v:,.0f} tok/s" for k, v in rates.items()),
                                    refresh=False)  # update() redraws, at most every 0.1 s
                for output in finished:
                    outputs[output.request_id] = output
                bar.update(len(finished))
        finally:
            bar.close()
            if not self.is_finished():  # interrupted: leave nothing half-run behind
                self.scheduler.abort_all()
                self.prompts.clear()
                self.times.clear()
        return [outputs[seq.seq_id] for seq in seqs]


class LLM(LLMEngine):
    """The user-facing engine, named as in vLLM."""
