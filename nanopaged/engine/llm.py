"""vLLM's `LLM` (and `LLMEngine`) over the core engine: requests in, `RequestOutput`s
out.

The core (`nanopaged/core/`) runs sequences; this layer owns what a request is beyond
its sequences: the prompt's text and tokens, its n samples, their text and stop strings,
their logprobs, the checks before anything is queued, and the engine's counters.
"""

import importlib
import time
import warnings
import weakref

from tqdm.auto import tqdm

from nanopaged.assembly import assemble
from nanopaged.checkpoint import (
    checkpoint_architecture,
    choose_runner,
    pools,
    resolve_model,
)
from nanopaged.core.config import Config
from nanopaged.core.sequence import Sequence
from nanopaged.core.step import SamplerOutput, ScheduledStep
from nanopaged.engine.arg_utils import make_config, split_options
from nanopaged.engine.compat import VLLMEngineAPI
from nanopaged.engine.training import TrainingAPI, transfer_backend
from nanopaged.inputs import (
    InputProcessor,
    Prompt,
    as_batch,
    check_priority,
    per_prompt,
)
from nanopaged.outputs import EngineStats, Request, RequestOutput, token_logprobs
from nanopaged.parallel.tensor import ParallelConfig
from nanopaged.sampling_params import SamplingParams

# a runner other than "generate" -> (the module, the name) of its engine, a subclass of
# LLM above this module: imported when asked for, so that a forker may delete it
RUNNERS = {"pooling": ("nanopaged.pooling.pooling_llm", "PoolingLLM")}


class LLM(VLLMEngineAPI, TrainingAPI):
    """The engine, as vLLM's: `LLM(model, **options).generate(prompts, params)`.

    Requests can also be run a step at a time: `add_request`, then `step()` until
    `is_finished()`; each step returns the outputs of the requests that advanced in it.
    `generate`, `chat` and `stream` refuse to start while such requests are unfinished
    (their outputs would be lost). Every request is checked before anything is queued:
    bad input is a ValueError and leaves the engine as it was. A step that raises (an
    error, Ctrl-C) aborts every unfinished request; the prefix cache keeps only K/V that
    was written. A failure in one request's own bookkeeping (its text, its stop strings)
    ends that request alone, with its `error` set. With `data_parallel_size` > 1,
    `LLM(...)` returns a `DataParallelLLM` instead (`data_parallel.py`): that many
    replicas of this engine, each in its own process, behind the same API.

    The features an option asks for are imported when it does, and put together in one
    place, `assembly.assemble` (speculative decoding, LoRA, images, async scheduling,
    tensor parallelism, the trace; data parallelism and pooling here): without them,
    their files could be deleted. With
    `runner="pooling"` (or a checkpoint that pools, see `checkpoint.choose_runner`),
    `LLM(...)` returns a `PoolingLLM` (`pooling/pooling_llm.py`): a subclass that makes
    its own requests (`make_request`), takes its own note of each step (`take`) and
    adapts the config before the runner is built (`prepare`).
    """

    runner_type = "generate"  # vLLM's name for what the engine does
    progress = "Generating"  # the progress bar's label
    params_types: tuple[type, ...] = (SamplingParams,)  # what add_request takes

    def __new__(cls, model: str = "Qwen/Qwen3-0.6B", **options):
        size = options.get("data_parallel_size")
        pooling = cls is LLM and choose_runner(model, options) == "pooling"
        if isinstance(size, int) and not isinstance(size, bool) and size > 1:
            if pooling:
                raise ValueError(
                    "runner='pooling' runs one engine: data_parallel_size > 1 is not "
                    "supported with it"
                )
            from nanopaged.engine.data_parallel import DataParallelLLM

            return DataParallelLLM(cls, model, **options)
        if pooling:
            module, name = RUNNERS["pooling"]
            return super().__new__(getattr(importlib.import_module(module), name))
        return super().__new__(cls)

    def __init__(self, model: str = "Qwen/Qwen3-0.6B", **options):
        core, parallel, surface = split_options(model, options)
        self.config = config = make_config(resolve_model(model), core)
        self.prepare(config, surface)
        self.parallel = ParallelConfig(**parallel)
        self.parallel.check(config)
        self.inputs = InputProcessor.for_checkpoint(config, surface)
        self.logprobs_mode = surface["logprobs_mode"]
        self.rl = None  # RL's state, made by the first RL method (training.py)
        self.training_options = (
            surface["enable_sleep_mode"],
            transfer_backend(surface["weight_transfer_config"]),
        )
        self.requests: dict[str, Request] = {}  # the unfinished ones
        # a sequence's request, sample
        self.owners: dict[Sequence, tuple[Request, int]] = {}
        # every feature an option turns on, put together in one place (assembly.py)
        parts = assemble(self, config, self.parallel, surface)
        self.engine, self.lora, self.tracer = parts.engine, parts.lora, parts.tracer
        self.images, self.vision = parts.images, parts.vision
        # tensor-parallel workers exit when the engine is closed or garbage-collected
        self._finalizer = weakref.finalize(self, self.engine.runner.close)
        self.inputs.num_blocks = self.engine.block_manager.num_blocks

    def prepare(self, config: Config, surface: dict) -> None:
        """Checks (and may adapt) the config before the runner is built: this engine
        generates, so the checkpoint must have an LM head."""
        architecture = checkpoint_architecture(config.hf_config)
        if pools(architecture):
            raise ValueError(
                f"{architecture} has no LM head: it cannot generate; "
                f"LLM(model, runner='pooling') embeds or classifies with it"
            )

    # ---- requests in ----

    def add_request(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        lora_request=None,
        priority: int = 0,
    ) -> str:
        """Queues one request (after checking it); returns its id. vLLM's order of
        arguments, `add_request(request_id, prompt, params)`, works too. `lora_request`:
        a LoRARequest (the engine made with `enable_lora`), or None for the base
        model; `priority` 0 (see `inputs.check_priority`)."""
        self._check_open()
        check_priority(priority)
        # vLLM's order
        if not isinstance(sampling_params, (*self.params_types, type(None))):
            request_id, prompt, sampling_params = prompt, sampling_params, request_id
        return self._enqueue(
            self.make_request(prompt, sampling_params, request_id, lora_request)
        )

    def make_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None,
        request_id: str | None = None,
        lora_request=None,
    ) -> Request:
        """A checked request of `prompt` (a ValueError names what is wrong)."""
        image_prompt = None
        if isinstance(prompt, dict) and "multi_modal_data" in prompt:
            if self.images is None:
                raise ValueError(
                    "this model takes no images: multi_modal_data needs a "
                    "vision-language model"
                )
            prompt = dict(prompt)
            images = self.images.images_of(prompt.pop("multi_modal_data"))
            image_prompt = self.images.process(prompt, images)
            prompt = image_prompt.prompt
        request = self.inputs.make_request(prompt, params, request_id, self.requests)
        if image_prompt is not None:
            self.images.attach(request, image_prompt, self.vision)
        elif self.images is not None:
            self.images.check_text_only(request.prompt_token_ids)
        if lora_request is not None:
            self._lora().prepare(request, lora_request)
        return request

    # ---- LoRA adapters (vLLM's LLMEngine methods) ----

    def add_lora(self, lora_request) -> bool:
        """Reads and checks an adapter now, before a request brings it."""
        self._lora().add(lora_request)
        return True

    def remove_lora(self, lora_id: int) -> bool:
        """Forgets the adapter and its cached blocks; False if none had that id."""
        return self._lora().remove(lora_id)

    def list_loras(self) -> set[int]:
        return self._lora().ids()

    def _lora(self):
        if self.lora is None:
            raise ValueError(
                "a lora_request needs LoRA enabled: create the engine with "
                "enable_lora=True (--enable-lora)"
            )
        return self.lora

    def _enqueue(self, request: Request) -> str:
        self.requests[request.request_id] = request
        request.weight_version = 0 if self.rl is None else self.rl.version
        if self.lora is not None and not self.lora.admits(request, self.engine):
            self.lora.held.append(request)  # until one of the engine's adapters is done
            return request.request_id
        self._add_to_engine(request)
        return request.request_id

    def _add_to_engine(self, request: Request) -> None:
        for index, seq in enumerate(request.seqs):
            self.owners[seq] = request, index
            self.engine.add(seq)

    def abort(self, request_id: str) -> None:
        """Drops a request and frees its blocks; an unknown or finished id is
        ignored."""
        request = self.requests.pop(request_id, None)
        if request is not None:
            if self.lora is not None and request in self.lora.held:
                self.lora.held.remove(request)
            self.engine.finish(request.seqs)
            self._forget(request)

    def _forget(self, request: Request) -> None:
        for seq in request.seqs:
            self.owners.pop(seq, None)

    # ---- steps ----

    def step(self) -> list[RequestOutput]:
        """Runs one step; returns an output (cumulative so far) for every request that
        got tokens in it, `finished` on its last. Returns [] when nothing is queued."""
        requests = self.run_step()[1]
        try:
            return [self._output(request) for request in requests]
        except BaseException:  # Ctrl-C: every request ends, as after a failed step
            self._abort_all()
            raise

    def run_step(self) -> tuple[ScheduledStep, list[Request]]:
        """`step()` without the outputs: runs a step of the core engine and takes note
        of what it sampled; returns the step and the requests that got tokens in it.
        Whatever raises in it (an error, Ctrl-C) aborts every unfinished request."""
        self._check_open()
        if self.tracer:
            self.tracer.begin()
        try:
            if self.lora is not None:  # the held requests whose adapter fits now
                self.lora.release(self.engine, self._add_to_engine)
            step, sampled = self.engine.step()
            requests = self.take(step, sampled)
        except BaseException as error:
            self._abort_all()
            if self.tracer:
                self.tracer.stepped(None, None, error)
            raise
        if self.tracer:
            self.tracer.stepped(step, sampled)
        return step, requests

    def take(self, step: ScheduledStep, sampled: SamplerOutput) -> list[Request]:
        """Takes note of each sampling sequence's tokens in its request (grammar,
        logprobs, stop strings), and of the prompt logprobs asked for. Returns the
        requests that got tokens, in the order of their first row; a request whose
        bookkeeping fails ends alone."""
        now, advanced = time.perf_counter(), {}
        # the prompt rows' logits follow the sampling sequences'
        start = sum(step.sample_counts)
        for i, count in step.prompt_logit_counts:
            logits, start = sampled.logits[start : start + count], start + count
            if step.seqs[i] not in self.owners:  # aborted while its step ran
                continue
            request, _ = self.owners[step.seqs[i]]
            targets = request.prompt_token_ids[step.starts[i] + 1 :][: len(logits)]
            try:
                request.record_prompt_logprobs(
                    step.starts[i] + 1,
                    token_logprobs(
                        logits, targets, [request.params.prompt_logprobs] * len(targets)
                    ),
                )
            except Exception as error:
                self._fail(request, error)
        logprobs = self._logprobs(step, sampled)
        for row, seq in enumerate(step.sampling_seqs):
            # aborted while its step ran, or ended the step before (async scheduling's
            # wasted row: no token)
            if seq not in self.owners or not sampled.token_ids[row]:
                continue
            request, index = self.owners[seq]
            advanced[request] = None
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            if not request.each_token and seq.finish_reason is None:
                continue  # nothing to take note of yet
            try:
                kept = request.take_tokens(index, logprobs.get(row))
                if kept is not None:  # a stop string ends there
                    self.engine.stop(seq, kept)
            except Exception as error:
                self._fail(request, error)
            if seq.finish_reason is not None and request.finished:
                request.metrics.finish_time = now
        return list(advanced)

    def _logprobs(self, step: ScheduledStep, sampled: SamplerOutput) -> dict[int, list]:
        """For the sampling sequences whose request asks for logprobs and that got
        tokens, those of their new tokens, each in the model's distribution at the row
        it came from (with `logprobs_mode="processed_logprobs"`, the one it was sampled
        from)."""
        asking = [
            row
            for row, seq in enumerate(step.sampling_seqs)
            if seq.sampling_params.logprobs is not None and sampled.token_ids[row]
        ]
        if not asking:
            return {}
        first_logit_rows = step.first_logit_rows
        rows = [
            first_logit_rows[r] + j
            for r in asking
            for j in range(len(sampled.token_ids[r]))
        ]
        logits = sampled.logits[rows]
        if self.logprobs_mode == "processed_logprobs":  # as they were sampled
            seqs = [step.sampling_seqs[r] for r in asking for _ in sampled.token_ids[r]]
            logits = self.engine.runner.sampler.processed(logits, seqs)
        entries = iter(
            token_logprobs(
                logits,
                [t for r in asking for t in sampled.token_ids[r]],
                [
                    step.sampling_seqs[r].sampling_params.logprobs
                    for r in asking
                    for _ in sampled.token_ids[r]
                ],
            )
        )
        return {r: [next(entries) for _ in sampled.token_ids[r]] for r in asking}

    def _fail(self, request: Request, error: Exception) -> None:
        """Ends `request` alone, with its error."""
        request.error = f"{type(error).__name__}: {error}"
        request.metrics.finish_time = time.perf_counter()
        self.engine.finish(request.seqs)

    def _output(self, request: Request) -> RequestOutput:
        """The request's output so far; a finished request leaves the engine with it."""
        try:
            output = request.output()
        except Exception as error:
            self._fail(request, error)
            output = request.output(with_text=False)
        if output.finished:
            self.requests.pop(request.request_id, None)
            self._forget(request)
        return output

    def _abort_all(self) -> None:
        """After a failed or interrupted step: every request ends, nothing half-run
        stays."""
        # also a sequence that an interrupt left in no queue; abort_all then repairs the
        # pool
        self.engine.finish(
            [seq for request in self.requests.values() for seq in request.seqs]
        )
        self.engine.abort_all()
        self.requests.clear()
        self.owners.clear()
        if self.lora is not None:
            self.lora.held.clear()

    def is_finished(self) -> bool:
        return self.engine.is_finished() and not (self.lora and self.lora.held)

    def stats(self) -> EngineStats:
        engine = self.engine
        scheduler, pool = engine.scheduler, engine.block_manager
        # speculative decoding's counters (see speculative.SpeculativeEngine), or none
        drafts, proposed, accepted = (
            getattr(engine, name, 0)
            for name in ("num_drafts", "num_proposed_tokens", "num_accepted_tokens")
        )
        return EngineStats(
            len(self.requests),
            len(scheduler.waiting),
            len(scheduler.running),
            pool.num_free_blocks,
            pool.num_blocks,
            scheduler.num_preemptions,
            engine.num_generated_tokens,
            drafts,
            proposed,
            accepted,
        )

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix; False (and nothing forgotten) while requests
        run."""
        return self.engine.block_manager.reset_prefix_cache()

    def reset_mm_cache(self) -> None:
        """vLLM's: forgets the images processed and encoded so far (a vision-language
        model's caches; nothing otherwise)."""
        self._check_idle("reset_mm_cache")
        if self.images is not None:
            self.images.processed.clear()
            self.vision.cache.clear()

    # ---- whole batches ----

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request=None,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        """Generates the completions of every prompt; returns one output per prompt, in
        order. `lora_request`: one LoRARequest for every prompt, or a list of one (or
        None) each; `priority` 0s (see `inputs.check_priority`)."""
        self._check_idle("generate")
        check_priority(priority)
        prompts, sampling_params = as_batch(prompts, sampling_params)
        adapters = per_prompt(lora_request, len(prompts))
        requests = [
            self.make_request(p, sp, lora_request=lr)
            for p, sp, lr in zip(prompts, sampling_params, adapters)
        ]
        return self.run_requests(requests, use_tqdm)

    def run_requests(self, requests: list, use_tqdm: bool) -> list:
        """Runs a batch of requests (from `make_request`) to their end; returns their
        outputs, in order, with a warning for each that failed alone. Interrupted, it
        leaves none of them behind."""
        try:
            for request in requests:
                self._enqueue(request)
            self._run(len(requests), use_tqdm)
            outputs = [self._output(request) for request in requests]
        finally:
            if self.requests:  # interrupted: no request of this call may stay behind
                for request_id in list(self.requests):
                    self.abort(request_id)
        for output in outputs:
            if output.error is not None:
                warnings.warn(
                    f"request {output.request_id} failed: {output.error}", stacklevel=3
                )
        return outputs

    def _run(self, num_requests: int, use_tqdm: bool) -> None:
        bar = tqdm(
            total=num_requests,
            desc=self.progress,
            dynamic_ncols=True,
            disable=not use_tqdm,
        )
        rates = {"prefill": 0.0, "decode": 0.0}
        with bar:
            while not self.is_finished():
                start = time.perf_counter()
                step, advanced = self.run_step()
                if use_tqdm:
                    seconds = time.perf_counter() - start
                    rates["prefill" if step.ragged else "decode"] = (
                        step.num_scheduled_tokens / seconds
                    )
                    # update() redraws, at most every 0.1 s
                    bar.set_postfix_str(
                        ", ".join(f"{k} {v:,.0f} tok/s" for k, v in rates.items()),
                        refresh=False,
                    )
                # a request gets tokens until it finishes (take() times its end)
                ended = [r for r in advanced if r.metrics.finish_time is not None]
                bar.update(len(ended))
