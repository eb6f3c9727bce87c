"""How one request samples and when it stops, with vLLM's names and meanings, at vLLM's
module path: the core's sampling options, and vLLM's own fields, every one checked."""

import math
from dataclasses import dataclass

from nanopaged.core.sequence import SamplingOptions

MAX_LOGPROBS = 20  # as vLLM's default max_logprobs
FLOAT32_MAX = 3.4028234663852886e38  # the sampler works in float32
LOGIT_BIAS_LIMIT = 100.0  # biases are clamped to [-100, 100], as in vLLM and OpenAI


@dataclass
class StructuredOutputsParams:
    """A constraint on a completion's text, as vLLM's: exactly one of a JSON schema
    (`json`, a dict or its text), any JSON object (`json_object=True`), a regular
    expression (`regex`), one of the strings of `choice`, or a GBNF or Lark `grammar`
    (see `sampling/structured_outputs.py`). `disable_any_whitespace` keeps JSON free of
    optional whitespace."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    backend: str | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None
    disable_fallback: bool = False
    disable_additional_properties: bool = False


GuidedDecodingParams = StructuredOutputsParams  # its name in vLLM before 0.11


@dataclass
class SamplingParams(SamplingOptions):
    """Sampling settings for one request, as in vLLM.

    `n` completions are sampled from one prompt, whose K/V is computed once and shared.
    `temperature=0` is greedy decoding. `top_k` of 0 or -1, `top_p=1.0` and `min_p=0`
    keep the whole vocabulary. `seed` makes this request's samples reproducible whatever
    else shares its batch. A completion stops at `max_tokens` (None: at
    `max_model_len`), at EOS (unless `ignore_eos`), at one of `stop_token_ids`, or at a
    `stop` string, which is cut from the text unless `include_stop_str_in_output`; none
    of these stops it before `min_tokens` tokens. `logprobs=k` returns, for each
    generated token, its log-probability and the k most likely tokens', from the model's
    distribution before any penalty, temperature or filtering; `prompt_logprobs=k` the
    same for every prompt token after the first.

    Before sampling, as vLLM: only `allowed_token_ids` may be sampled, never the last
    token of a `bad_words` entry whose other tokens were just generated; `logit_bias`
    adds to a token's logit; `repetition_penalty` divides the positive logits
    (multiplies the negative ones) of tokens in the prompt or the completion;
    `frequency_penalty` and `presence_penalty` subtract, per token of the completion,
    its count and 1. `structured_outputs` (vLLM's `guided_decoding` before 0.11)
    constrains the text to a JSON schema, a regex, a choice or a grammar.
    """

    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_decoding: StructuredOutputsParams | None = None  # vLLM's name before 0.11

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raises ValueError naming the first invalid field (also called when a request
        is added, in case a field was changed since)."""
        for name, low, high in INT_RANGES:
            if getattr(self, name) is not None or name in ("n", "top_k", "min_tokens"):
                _check_int(name, getattr(self, name), low, high)
        if self.max_tokens is not None and self.max_tokens < self.min_tokens:
            raise ValueError(
                f"max_tokens={self.max_tokens} is less than "
                f"min_tokens={self.min_tokens}"
            )
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of={self.best_of} must be >= n={self.n}")
        for name, low, high, low_open in FLOAT_RANGES:
            value = getattr(self, name)
            if (
                not _is_number(value)
                or not (low < value if low_open else low <= value)
                or not value <= high
            ):
                bounds = f"{'(' if low_open else '['}{low:g}, {high:g}]"
                raise ValueError(f"{name} must be a number in {bounds}, got {value!r}")
        for name in (
            "include_stop_str_in_output",
            "ignore_eos",
            "skip_special_tokens",
            "detokenize",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"{name} must be True or False, got {getattr(self, name)!r}"
                )
        for name in ("stop", "bad_words"):
            if not _is_strings(getattr(self, name), allow_one=name == "stop"):
                raise ValueError(
                    f"{name} must be a non-empty string or a list of them, "
                    f"got {getattr(self, name)!r}"
                )
        if self.stop and not self.detokenize:
            raise ValueError(
                "stop strings need the text: they cannot be used with detokenize=False"
            )
        self._check_token_ids()
        for name in ("structured_outputs", "guided_decoding"):
            if not isinstance(
                getattr(self, name), (StructuredOutputsParams, type(None))
            ):
                raise ValueError(
                    f"{name} must be StructuredOutputsParams, got "
                    f"{getattr(self, name)!r}"
                )
        if self.structured_outputs and self.guided_decoding:
            raise ValueError("give structured_outputs or guided_decoding, not both")
        if (self.structured_outputs or self.guided_decoding) and self.min_tokens:
            raise ValueError(
                "min_tokens does not go with structured outputs: the constraint "
                "alone decides where the text may end"
            )

    def _check_token_ids(self) -> None:
        for name in ("stop_token_ids", "allowed_token_ids"):
            token_ids = getattr(self, name)
            if not isinstance(token_ids or [], (list, tuple, set)):
                raise ValueError(
                    f"{name} must be a list of token ids, got {token_ids!r}"
                )
            for token_id in token_ids or []:
                _check_int(name, token_id, 0)
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError(
                "allowed_token_ids must not be empty: nothing could be sampled"
            )
        if not isinstance(self.logit_bias or {}, dict):
            raise ValueError(
                f"logit_bias must map token ids to numbers, got {self.logit_bias!r}"
            )
        for token_id, bias in (self.logit_bias or {}).items():
            _check_int("logit_bias token id", token_id, 0)
            if not _is_number(bias) or bias != bias:
                raise ValueError(
                    f"logit_bias for token {token_id} must be a number, got {bias!r}"
                )

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def all_token_ids(self) -> list[int]:
        """Every token id the parameters name, for checking against the vocabulary."""
        return [
            *(self.stop_token_ids or ()),
            *(self.allowed_token_ids or ()),
            *(self.logit_bias or {}),
        ]


# name, smallest and largest value of the integer fields (None: unbounded)
# the seeds torch.Generator takes
INT_RANGES = [
    ("n", 1, None),
    ("best_of", 1, None),
    ("top_k", -1, None),
    ("min_tokens", 0, None),
    ("max_tokens", 1, None),
    ("logprobs", 0, MAX_LOGPROBS),
    ("prompt_logprobs", 0, MAX_LOGPROBS),
    ("truncate_prompt_tokens", 1, None),
    ("seed", -(2**63), 2**64 - 1),
]
# name, bounds, and whether the lower bound is excluded, of the number fields
FLOAT_RANGES = [
    ("temperature", 0, FLOAT32_MAX, False),
    ("top_p", 0, 1, True),
    ("min_p", 0, 1, False),
    ("presence_penalty", -2, 2, False),
    ("frequency_penalty", -2, 2, False),
    ("repetition_penalty", 0, FLOAT32_MAX, True),
]


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_strings(value, allow_one: bool) -> bool:
    if value is None or allow_one and isinstance(value, str) and value:
        return True
    return isinstance(value, (list, tuple)) and all(
        isinstance(s, str) and s for s in value
    )


def _check_int(name: str, value, low: int, high: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bounds = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {bounds}, got {value}")


@dataclass
class BeamSearchParams:
    """vLLM's settings of `LLM.beam_search` (`nanopaged/beam_search.py`): the
    `beam_width` best sequences of up to `max_tokens` tokens, each round's candidates
    the `2 * beam_width` most likely next tokens of each beam (so `beam_width` is at
    most half of vLLM's default `max_logprobs`, 20); ranked by cumulative logprob over
    length to the power `length_penalty`; EOS ends a beam unless `ignore_eos`."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        _check_int("beam_width", self.beam_width, 1, MAX_LOGPROBS // 2)
        _check_int("max_tokens", self.max_tokens, 1)
        if not _is_number(self.temperature) or not 0 <= self.temperature <= FLOAT32_MAX:
            raise ValueError(
                f"temperature must be a number in [0, {FLOAT32_MAX:g}], got "
                f"{self.temperature!r}"
            )
        if not _is_number(self.length_penalty) or not math.isfinite(
            self.length_penalty
        ):
            raise ValueError(
                f"length_penalty must be a finite number, got {self.length_penalty!r}"
            )
