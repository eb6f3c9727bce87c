"""Requests in: a prompt (a text, token ids, or vLLM's TextPrompt / TokensPrompt) and
its SamplingParams, checked and made into a `Request` before anything is queued. Bad
input is a ValueError naming the problem. At vLLM's module path (`vllm.inputs`) for the
prompt types."""

import itertools
import threading
from typing import TypedDict

import numpy as np
import xxhash
from transformers import PreTrainedTokenizerBase

from nanopaged.chat import check_text
from nanopaged.checkpoint import (
    eos_token_ids,
    generation_defaults,
    load_tokenizer,
    resolve_model,
)
from nanopaged.core.config import Config
from nanopaged.core.sequence import Sequence, cdiv
from nanopaged.outputs import Request
from nanopaged.sampling.logits_processors import SamplingAdjustments
from nanopaged.sampling_params import SamplingParams


class PromptOptions(TypedDict, total=False):
    """What a prompt dict may bring besides its text or token ids, as vLLM's: its images
    (a vision-language model's), their processing, and its `cache_salt`."""

    multi_modal_data: dict
    mm_processor_kwargs: dict
    cache_salt: str


class TextPrompt(PromptOptions):
    prompt: str


class TokensPrompt(PromptOptions):
    prompt_token_ids: list[int]


# A text, token ids, or one of the dicts above (with both keys: token ids rendered from
# the text)
Prompt = str | list[int] | dict


class InputProcessor:
    """Makes requests of one engine: tokenizes their prompts, checks them against the
    model, the pool and the limits, and gives each sample its sequence: its stop tokens,
    its logits processors, its seed. The grammars of structured outputs are built on the
    first request that asks for one (`grammars`). `num_blocks`, the size of the KV pool,
    is set once the engine has sized it."""

    def __init__(
        self,
        config: Config,
        tokenizer: PreTrainedTokenizerBase,
        eos_token_ids: frozenset[int],
        default_sampling: dict,
        structured_outputs_config: dict | None = None,
    ):
        self.config, self.tokenizer, self.num_blocks = config, tokenizer, 0
        self.eos_token_ids, self.default_sampling = eos_token_ids, default_sampling
        self.structured_outputs_config = structured_outputs_config or {}
        self.request_ids = itertools.count()
        self._grammars, self._lock = None, threading.Lock()

    @classmethod
    def for_checkpoint(cls, config: Config, surface: dict) -> "InputProcessor":
        """The processor of the checkpoint `config.model` with the surface's options:
        its tokenizer (or `tokenizer`'s), EOS ids and default sampling settings (checked
        now)."""
        if surface["tokenizer_mode"] != "auto":
            raise ValueError(
                f"tokenizer_mode={surface['tokenizer_mode']!r} is not supported: "
                f"nanopaged loads the fast tokenizer (tokenizer.json), as vLLM's "
                f"'auto' does"
            )
        tokenizer = load_tokenizer(resolve_model(surface["tokenizer"] or config.model))
        defaults = generation_defaults(config.model, surface["generation_config"])
        SamplingParams(**defaults)
        return cls(
            config,
            tokenizer,
            eos_token_ids(config.model, config.hf_config, tokenizer),
            defaults,
            surface["structured_outputs_config"],
        )

    def grammars(self):
        """The structured outputs' grammars (llguidance), built on first use."""
        with self._lock:
            if self._grammars is None:
                try:
                    from nanopaged.sampling.structured_outputs import Grammars
                except ImportError:
                    raise ValueError(
                        "structured outputs need llguidance: pip install "
                        "'nanopaged[structured]'"
                    ) from None
                self._grammars = Grammars(
                    self.tokenizer,
                    self.config.hf_config.vocab_size,
                    self.eos_token_ids,
                    self.structured_outputs_config,
                )
        return self._grammars

    def make_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None,
        request_id: str | None,
        ids_in_use,
    ) -> Request:
        params = SamplingParams(**self.default_sampling) if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(
                f"sampling_params must be SamplingParams, got {type(params).__name__}"
            )
        params.validate()
        salt = salted(prompt)
        text, token_ids = self.tokenize(prompt)
        token_ids = token_ids[-(params.truncate_prompt_tokens or len(token_ids)) :]
        self._check_fits(token_ids, params)
        request_id = self.request_id(request_id, ids_in_use)
        spec = params.structured_outputs or params.guided_decoding
        matchers = (
            self.grammars().matchers(spec, params.n) if spec is not None else None
        )
        stop_token_ids = frozenset(params.stop_token_ids or ()) | (
            frozenset() if params.ignore_eos else self.eos_token_ids
        )
        adjustments = (
            SamplingAdjustments(params, self.tokenizer)
            if SamplingAdjustments.wanted(params)
            else None
        )
        seqs = []
        for i in range(params.n):
            processors = [
                p for p in (adjustments, matchers and matchers[i]) if p is not None
            ]
            # sample 0 is what n=1 gives; the others get their own, fixed, seeds
            seed = (
                params.seed if i == 0 or params.seed is None else hash((params.seed, i))
            )
            seq = Sequence(token_ids, params)
            seq.stop_token_ids = stop_token_ids
            seq.logits_processors = processors
            seq.seed = seed
            seq.prompt_logits = params.prompt_logprobs is not None and i == 0
            seq.cache_salt = salt
            seqs.append(seq)
        return Request(
            request_id, text, token_ids, params, seqs, self.tokenizer, matchers
        )

    def request_id(self, request_id: str | None, ids_in_use) -> str:
        """`request_id`, checked; None: the first automatic id nobody chose."""
        if request_id is None:
            request_id = next(
                i for i in map(str, self.request_ids) if i not in ids_in_use
            )
        if not isinstance(request_id, str) or request_id in ids_in_use:
            raise ValueError(
                f"request_id must be a string not in use, got {request_id!r}"
            )
        return request_id

    def _check_fits(self, token_ids: list[int], params: SamplingParams) -> None:
        """Whether the engine can ever run the request: its length, its blocks, its
        samples."""
        config, vocab_size = self.config, self.config.hf_config.vocab_size
        if len(token_ids) >= config.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens; it must be shorter than "
                f"max_model_len={config.max_model_len}"
            )
        longest = min(
            len(token_ids) + (params.max_tokens or config.max_model_len),
            config.max_model_len,
        )
        blocks_needed = cdiv(longest, config.kvcache_block_size)
        if blocks_needed > self.num_blocks:
            raise ValueError(
                f"request needs up to {blocks_needed} KV-cache blocks ({longest} "
                f"tokens) but the pool has only {self.num_blocks}; lower "
                f"max_tokens or give the cache more memory"
            )
        if params.n > config.max_num_seqs:
            raise ValueError(
                f"n={params.n} samples cannot run at once with "
                f"max_num_seqs={config.max_num_seqs}"
            )
        if (params.best_of or params.n) > params.n:
            raise ValueError(
                f"best_of={params.best_of} > n={params.n} is not supported (nor by "
                f"vLLM's V1 engine); sample n and rank them by cumulative_logprob"
            )
        outside = [t for t in params.all_token_ids() if t >= vocab_size]
        if outside:
            raise ValueError(
                f"token ids {outside} (in stop_token_ids, allowed_token_ids or "
                f"logit_bias) reach outside the vocabulary [0, {vocab_size})"
            )

    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """A prompt's text (None for token ids alone) and its checked token ids."""
        if isinstance(prompt, dict):
            if "multi_modal_data" in prompt:  # a vision-language model's LLM takes it
                raise ValueError(
                    "this engine takes no images: multi_modal_data needs a "
                    "vision-language model, generating (runner='generate')"
                )
            keys = set(prompt) - {"cache_salt"}
            if not keys or not keys <= {"prompt", "prompt_token_ids"}:
                raise ValueError(
                    f"a prompt dict takes the key 'prompt' (a text) or "
                    f"'prompt_token_ids', and 'cache_salt', as vLLM's TextPrompt and "
                    f"TokensPrompt; got keys {sorted(prompt)}"
                )
            text, token_ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
            if "prompt" in prompt and not isinstance(text, str):
                raise ValueError(
                    f"a prompt dict's 'prompt' takes a text, got "
                    f"{type(text).__name__} (token ids go in 'prompt_token_ids')"
                )
            if "prompt_token_ids" in prompt and not isinstance(
                token_ids, (list, tuple)
            ):
                raise ValueError(
                    f"a prompt dict's 'prompt_token_ids' takes a list of token ids, "
                    f"got {type(token_ids).__name__} (a text goes in 'prompt')"
                )
            if token_ids is not None:  # with a text: the one they came from (a chat)
                return text, self.tokenize(token_ids)[1]
            prompt = text
        if isinstance(prompt, str):
            check_text(prompt, "prompt")
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            text, token_ids = None, token_id_list(prompt)
        else:
            raise ValueError(
                f"a prompt must be a string or a list of token ids, got "
                f"{type(prompt).__name__}"
            )
        if not token_ids:
            raise ValueError("prompt is empty")
        vocab_size = self.config.hf_config.vocab_size
        ids = np.asarray(token_ids)
        outside = np.flatnonzero((ids < 0) | (ids >= vocab_size))
        if outside.size:  # named as given: a float array would round 2**63
            raise ValueError(
                f"token id {token_ids[outside[0]]} is outside the vocabulary "
                f"[0, {vocab_size})"
                + (": the tokenizer does not match the model" if text else "")
            )
        return text, token_ids


def salted(prompt: Prompt) -> int | None:
    """The start of the hash chain of a prompt's blocks from its `cache_salt` (vLLM's:
    prompts with other salts, or none, share no cached block), or None."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        raise ValueError(f"cache_salt must be a non-empty string, got {salt!r}")
    return xxhash.xxh64(f"cache_salt {salt}".encode()).intdigest()


def check_priority(priority) -> None:
    """vLLM's `priority` of a request (a number, or a list of one per prompt): only 0,
    as requests are served in the order they came (vLLM's "fcfs" policy, which refuses
    any other)."""
    for value in priority if isinstance(priority, (list, tuple)) else [priority]:
        if value not in (None, 0):
            raise ValueError(
                f"priority {value!r} needs priority scheduling, which nanopaged does "
                f"not have: requests are served in the order they came "
                f"(scheduling_policy='fcfs'), each at priority 0"
            )


def as_batch(prompts, sampling_params) -> tuple[list, list]:
    """`generate`'s arguments as a list of prompts and a list of as many sampling
    params."""
    if isinstance(prompts, (str, dict)) or (
        isinstance(prompts, (list, tuple))
        and prompts
        and isinstance(prompts[0], (int, np.integer))
    ):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(
            f"prompts must be a prompt or a list of prompts, got "
            f"{type(prompts).__name__}"
            + (" (pass array.tolist())" if isinstance(prompts, np.ndarray) else "")
        )
    if not isinstance(sampling_params, (list, tuple)):
        sampling_params = [sampling_params] * len(prompts)
    if len(sampling_params) != len(prompts):
        raise ValueError(
            f"got {len(prompts)} prompts but {len(sampling_params)} sampling params"
        )
    return list(prompts), list(sampling_params)


def per_prompt(value, num_prompts: int) -> list:
    """An argument given once for a batch or as a list of one per prompt, as that
    list."""
    if not isinstance(value, (list, tuple)):
        return [value] * num_prompts
    if len(value) != num_prompts:
        raise ValueError(f"got {num_prompts} prompts but {len(value)} lora requests")
    return list(value)


def token_id_list(values: list | tuple) -> list[int]:
    """Token ids as a list of ints: a prompt of Python ints alone is checked at C speed
    (its thousands of ids), any other one by one, naming the first that is not one."""
    if set(map(type, values)) <= {int}:
        return list(values)
    return [_token_id(t) for t in values]


def _token_id(value) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(
            f"token ids must be integers, got {value!r} ({type(value).__name__})"
        )
    return int(value)
