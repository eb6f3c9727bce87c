"""Requests in: a prompt (a text, token ids, or vLLM's TextPrompt / TokensPrompt) and its
SamplingParams, checked and made into a `Request` before anything is queued. Bad input is a
ValueError naming the problem. At vLLM's module path (`vllm.inputs`) for the prompt types."""
import itertools
import os
from typing import TypedDict

import numpy as np
from transformers import AutoTokenizer, GenerationConfig, PreTrainedTokenizerBase

from nanopaged.chat import check_text
from nanopaged.config import Config
from nanopaged.logits_processors import bad_words_token_ids
from nanopaged.outputs import Request
from nanopaged.sampling_params import SamplingParams
from nanopaged.sequence import Sequence

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


class TextPrompt(TypedDict):
    prompt: str


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]


# A text, token ids, or one of the dicts above (with both keys: token ids rendered from the text)
Prompt = str | list[int] | dict


class InputProcessor:
    """Makes requests of one engine: tokenizes their prompts, checks them against the model,
    the pool and the limits, and gives each sample its sequence."""

    def __init__(self, config: Config, tokenizer: PreTrainedTokenizerBase, num_blocks: int,
                 eos_token_ids: frozenset[int], default_sampling: dict, grammars):
        self.config, self.tokenizer, self.num_blocks = config, tokenizer, num_blocks
        self.eos_token_ids, self.default_sampling = eos_token_ids, default_sampling
        self.grammars = grammars  # () -> the structured outputs' grammars, built on first use
        self.request_ids = itertools.count()

    def make_request(self, prompt: Prompt, params: SamplingParams | None,
                     request_id: str | None, ids_in_use) -> Request:
        params = SamplingParams(**self.default_sampling) if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        params.validate()
        text, token_ids = self.tokenize(prompt)
        token_ids = token_ids[-(params.truncate_prompt_tokens or len(token_ids)):]
        self._check_fits(token_ids, params)
        params.bad_words_token_ids = bad_words_token_ids(params, self.tokenizer)
        if request_id is None:  # the first automatic id nobody chose
            request_id = next(i for i in map(str, self.request_ids) if i not in ids_in_use)
        if not isinstance(request_id, str) or request_id in ids_in_use:
            raise ValueError(f"request_id must be a string not in use, got {request_id!r}")
        stop_token_ids = frozenset(params.stop_token_ids or ()) | (
            frozenset() if params.ignore_eos else self.eos_token_ids)
        seqs = [Sequence(token_ids, params, self.config.kvcache_block_size, stop_token_ids,
                         request_id, i) for i in range(params.n)]
        spec = params.structured_outputs or params.guided_decoding
        if spec is not None:
            for seq, matcher in zip(seqs, self.grammars().matchers(spec, len(seqs))):
                seq.grammar = matcher
        seqs[0].forks = seqs[1:]
        return Request(request_id, text, token_ids, params, seqs, self.tokenizer)

    def _check_fits(self, token_ids: list[int], params: SamplingParams) -> None:
        """Whether the engine can ever run the request: its length, its blocks, its samples."""
        config, vocab_size = self.config, self.config.hf_config.vocab_size
        if len(token_ids) >= config.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens; it must be shorter than "
                             f"max_model_len={config.max_model_len}")
        longest = min(len(token_ids) + (params.max_tokens or config.max_model_len),
                      config.max_model_len)
        blocks_needed = -(-longest // config.kvcache_block_size)
        if blocks_needed > self.num_blocks:
            raise ValueError(f"request needs up to {blocks_needed} KV-cache blocks ({longest} "
                             f"tokens) but the pool has only {self.num_blocks}; lower "
                             f"max_tokens or give the cache more memory")
        if params.n > config.max_num_seqs:
            raise ValueError(f"n={params.n} samples cannot run at once with "
                             f"max_num_seqs={config.max_num_seqs}")
        if (params.best_of or params.n) > params.n:
            raise ValueError(f"best_of={params.best_of} > n={params.n} is not supported (nor by "
                             f"vLLM's V1 engine); sample n and rank them by cumulative_logprob")
        outside = [t for t in params.all_token_ids() if t >= vocab_size]
        if outside:
            raise ValueError(f"token ids {outside} (in stop_token_ids, allowed_token_ids or "
                             f"logit_bias) reach outside the vocabulary [0, {vocab_size})")

    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """A prompt's text (None for token ids alone) and its checked token ids."""
        if isinstance(prompt, dict):
            if not prompt or not set(prompt) <= {"prompt", "prompt_token_ids"}:
                raise ValueError(f"a prompt dict takes the key 'prompt' (a text) or "
                                 f"'prompt_token_ids', as vLLM's TextPrompt and TokensPrompt; "
                                 f"got keys {sorted(prompt)}")
            if len(prompt) == 2:  # the text the token ids came from (a rendered chat)
                return prompt["prompt"], self.tokenize(prompt["prompt_token_ids"])[1]
            prompt = next(iter(prompt.values()))
        if isinstance(prompt, str):
            check_text(prompt, "prompt")
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            text, token_ids = None, [_token_id(t) for t in prompt]
        else:
            raise ValueError(f"a prompt must be a string or a list of token ids, got "
                             f"{type(prompt).__name__}")
        if not token_ids:
            raise ValueError("prompt is empty")
        vocab_size = self.config.hf_config.vocab_size
        outside = next((t for t in token_ids if not 0 <= t < vocab_size), None)
        if outside is not None:
            raise ValueError(f"token id {outside} is outside the vocabulary [0, {vocab_size})"
                             + (": the tokenizer does not match the model" if text else ""))
        return text, token_ids


def as_batch(prompts, sampling_params) -> tuple[list, list]:
    """`generate`'s arguments as a list of prompts and a list of as many sampling params."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                            and isinstance(prompts[0], (int, np.integer))):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(f"prompts must be a prompt or a list of prompts, got "
                         f"{type(prompts).__name__}"
                         + (" (pass array.tolist())" if isinstance(prompts, np.ndarray) else ""))
    if not isinstance(sampling_params, (list, tuple)):
        sampling_params = [sampling_params] * len(prompts)
    if len(sampling_params) != len(prompts):
        raise ValueError(f"got {len(prompts)} prompts but {len(sampling_params)} sampling params")
    return list(prompts), list(sampling_params)


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    # without these, transformers makes an empty tokenizer rather than fail
    if not any(os.path.exists(os.path.join(path, f)) for f in TOKENIZER_FILES):
        raise ValueError(f"cannot load the tokenizer of {path!r}: it has none of "
                         f"{', '.join(TOKENIZER_FILES)}")
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as error:
        raise ValueError(f"cannot load the tokenizer of {path!r}: {error}") from None


def eos_token_ids(config: Config, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """The generation config's EOS ids, else the model config's, else the tokenizer's."""
    eos = None
    if os.path.exists(os.path.join(config.model, "generation_config.json")):
        eos = GenerationConfig.from_pretrained(config.model).eos_token_id
    for fallback in (getattr(config.hf_config, "eos_token_id", None), tokenizer.eos_token_id):
        eos = fallback if eos is None else eos
    return frozenset([] if eos is None else eos if isinstance(eos, list) else [eos])


def _token_id(value) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"token ids must be integers, got {value!r} ({type(value).__name__})")
    return int(value)
