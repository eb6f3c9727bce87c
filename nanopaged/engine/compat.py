"""The methods of vLLM's `LLM` and `LLMEngine` that vLLM's examples call beyond
`generate`, `add_request` and `step`, written on those alone, so that one engine and its
data-parallel replicas (`engine/data_parallel.py`) share them: `chat`, `stream`,
`from_engine_args`, and vLLM's other names. Nothing here changes what the engine
does."""

import dataclasses
import os
import time
from collections.abc import Iterable, Iterator

import torch

from nanopaged import chat
from nanopaged.checkpoint import is_multimodal
from nanopaged.engine.arg_utils import EngineArgs
from nanopaged.inputs import Prompt
from nanopaged.sampling_params import SamplingParams


def applied(worker, func):
    """`func` of a rank's model (`apply_model`, through `collective_rpc`)."""
    return func(worker.module)


class EnginePaused(RuntimeError):
    """Generation refused while the engine sleeps or its weights change (see
    `rl/control.py`): until `wake_up` or `finish_weight_update`."""


class VLLMEngineAPI:
    """A mixin of an engine that has `generate`, `add_request`, `step`, `abort`,
    `is_finished`, `requests` (the unfinished ones added with `add_request`), `inputs`
    (its `InputProcessor`) and `_finalizer` (which closes it)."""

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs):
        return cls(**dataclasses.asdict(engine_args))

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
        chat_template_content_format: str = "auto",
        lora_request=None,
        mm_processor_kwargs: dict | None = None,
    ) -> list:
        """`generate` for one conversation (a list of messages, see `chat.render`) or a
        list of them, each rendered by the chat template, as vLLM's `LLM.chat`; each
        output's `prompt` is the rendered text. Content parts render as a string ("auto"
        and "string" formats); image parts go to a vision-language model, processed
        with `mm_processor_kwargs` over the engine's."""
        if chat_template_content_format not in ("auto", "string"):
            raise ValueError(
                f"chat_template_content_format={chat_template_content_format!r} is "
                f"not supported: text parts always render as one string"
            )
        conversations = (
            [messages] if messages and isinstance(messages[0], dict) else messages
        )
        prompts = []
        for conversation in (
            conversations if isinstance(conversations, list) else [None]
        ):
            text, token_ids, images = chat.render(
                self.tokenizer,
                conversation,
                chat_template,
                add_generation_prompt,
                continue_final_message,
                tools,
                chat_template_kwargs,
                takes_images=is_multimodal(self.inputs.config.hf_config),
            )
            prompt = {"prompt": text, "prompt_token_ids": token_ids}
            if images:
                prompt["multi_modal_data"] = {"image": images}
                prompt["mm_processor_kwargs"] = mm_processor_kwargs
            prompts.append(prompt)
        return self.generate(
            prompts, sampling_params, use_tqdm, lora_request=lora_request
        )

    def stream(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None
    ) -> Iterator[str]:
        """Yields the text of one completion as it grows: `for delta in
        llm.stream(prompt):`. Leaving the loop early aborts the request."""
        self._check_idle("stream")
        if sampling_params is not None and getattr(sampling_params, "n", 1) != 1:
            raise ValueError(
                "stream() follows one completion; for n > 1 use add_request() "
                "and step()"
            )
        request_id, shown, finished = (
            self.add_request(prompt, sampling_params),
            0,
            False,
        )
        try:
            while not finished:
                for output in self.step():
                    text, finished = output.outputs[0].text, output.finished
                    if text[shown:]:
                        yield text[shown:]
                    shown = len(text)
        finally:
            self.abort(request_id)  # left early, or interrupted: ignored once finished

    def beam_search(
        self,
        prompts: Prompt | list[Prompt],
        params,
        lora_request=None,
        use_tqdm: bool = False,
        concurrency_limit: int | None = None,
    ) -> list:
        """vLLM's beam search (`nanopaged/beam_search.py`): for each prompt a
        `BeamSearchOutput`, its `params.beam_width` best sequences (`params`: a
        `BeamSearchParams`); `concurrency_limit` prompts searched at a time (None:
        all)."""
        from nanopaged.beam_search import beam_search
        from nanopaged.inputs import as_batch, per_prompt

        prompts, _ = as_batch(prompts, None)
        adapters = per_prompt(lora_request, len(prompts))
        size = max(len(prompts), 1) if concurrency_limit is None else concurrency_limit
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"concurrency_limit must be >= 1, got {size!r}")
        return [
            output
            for start in range(0, len(prompts), size)
            for output in beam_search(
                self,
                prompts[start : start + size],
                params,
                adapters[start : start + size],
                use_tqdm,
            )
        ]

    def apply_model(self, func) -> list:
        """vLLM's: `func(model)` on every rank's model (an `nn.Module`; on a CPU its
        packed projections keep their weights in their methods), the results in rank
        order; a function sent to another process travels pickled (define it at a
        module's top level)."""
        return self.collective_rpc(applied, args=(func,))

    def has_unfinished_requests(self) -> bool:
        return not self.is_finished()

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        for one in [request_id] if isinstance(request_id, str) else request_id:
            self.abort(one)

    @property
    def tokenizer(self):
        return self.inputs.tokenizer

    @property
    def default_sampling(self) -> dict:
        return self.inputs.default_sampling

    def get_tokenizer(self):
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the sampling settings of the checkpoint's generation
        config (unless generation_config="vllm"), as vLLM gives `generate` when none are
        passed."""
        return SamplingParams(**self.default_sampling)

    def start_profile(self) -> None:
        """Starts torch.profiler on this process (rank 0); `stop_profile` writes a
        Chrome trace into $VLLM_TORCH_PROFILER_DIR (or
        $NANOPAGED_TORCH_PROFILER_DIR)."""
        directory = os.environ.get("VLLM_TORCH_PROFILER_DIR") or os.environ.get(
            "NANOPAGED_TORCH_PROFILER_DIR"
        )
        if not directory:
            raise ValueError(
                "start_profile() writes its trace to the directory named by "
                "VLLM_TORCH_PROFILER_DIR; set it first"
            )
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(activities=activities)
        self.profiler.directory = directory
        self.profiler.start()

    def stop_profile(self) -> str:
        """Stops the profiler; returns the trace's path."""
        if getattr(self, "profiler", None) is None:
            raise ValueError("stop_profile() without start_profile()")
        self.profiler.stop()
        os.makedirs(self.profiler.directory, exist_ok=True)
        path = os.path.join(
            self.profiler.directory,
            f"nanopaged-{os.getpid()}-{time.time():.0f}.trace.json",
        )
        self.profiler.export_chrome_trace(path)
        self.profiler = None
        return path

    def embed(self, *args, **kwargs) -> list:
        """vLLM's pooling methods (`embed`, `classify`, `score`, `encode`): a pooling
        engine's (`pooling/pooling_llm.py`); this one generates, and says so."""
        raise ValueError(
            "this engine generates (runner='generate'): embed(), classify(), score() "
            "and encode() need a pooling one, LLM(model, runner='pooling')"
        )

    classify = score = encode = embed

    def grammars(self):
        """The structured outputs' grammars (see `InputProcessor.grammars`)."""
        return self.inputs.grammars()

    def _check_closed(self) -> None:
        if not self._finalizer.alive:
            raise RuntimeError("the engine is closed; create a new one")

    def _check_open(self) -> None:
        """Whether the engine may generate: not closed, and nothing of RL's refuses
        (asleep, mid-update: `rl/control.py`)."""
        self._check_closed()
        if (reason := self.paused()) is not None:
            raise EnginePaused(reason)

    def paused(self) -> str | None:
        """Why the engine does not generate now (asleep, mid-update), or None."""
        rl = getattr(self, "rl", None)
        return None if rl is None else rl.refusal()

    def _check_idle(self, method: str) -> None:
        self._check_open()
        if self.requests:
            raise ValueError(
                f"{len(self.requests)} requests added with add_request() are "
                f"unfinished; run step() until is_finished() or abort() them "
                f"before {method}()"
            )

    def close(self) -> None:
        """Stops the engine's processes (tensor-parallel workers, replicas), if any. The
        engine is unusable after."""
        self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
