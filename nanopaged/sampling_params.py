"""How one request samples and when it stops, with vLLM's names and meanings."""
from dataclasses import dataclass

MAX_LOGPROBS = 20  # as vLLM's default max_logprobs
FLOAT32_MAX = 3.4028234663852886e38  # the sampler works in float32


@dataclass
class SamplingParams:
    """Sampling settings for one request, as in vLLM.

    `n` completions are sampled from one prompt, whose K/V is computed once and shared.
    `temperature=0` is greedy decoding. `top_k` of 0 or -1 and `top_p=1.0` keep the whole
    vocabulary. `seed` makes this request's samples reproducible whatever else shares its batch.
    A completion stops at `max_tokens` (None: at `max_model_len`), at EOS (unless `ignore_eos`),
    at one of `stop_token_ids`, or at a `stop` string, which is cut from the text unless
    `include_stop_str_in_output`; none of these stops it before `min_tokens` tokens.
    `logprobs=k` returns, for each generated token, its log-probability and the k most likely
    tokens', from the model's distribution before temperature and filtering.
    """
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raises ValueError naming the first invalid field (also called when a request is added,
        in case a field was changed since)."""
        _check_int("n", self.n, 1)
        _check_int("top_k", self.top_k, -1)
        _check_int("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1)
            if self.max_tokens < self.min_tokens:
                raise ValueError(f"max_tokens={self.max_tokens} is less than "
                                 f"min_tokens={self.min_tokens}")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if self.seed is not None:
            _check_int("seed", self.seed, -2 ** 63, 2 ** 64 - 1)  # what torch.Generator takes
        if not _is_number(self.temperature) or not 0 <= self.temperature <= FLOAT32_MAX:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.stop is not None and not (isinstance(self.stop, (str, list, tuple)) and all(
                isinstance(s, str) and s for s in self.stop_strings)):
            raise ValueError(f"stop must be a non-empty string or a list of them, "
                             f"got {self.stop!r}")
        if not isinstance(self.stop_token_ids or [], (list, tuple, set)):
            raise ValueError(f"stop_token_ids must be a list of token ids, "
                             f"got {self.stop_token_ids!r}")
        for token_id in self.stop_token_ids or []:
            _check_int("stop_token_ids", token_id, 0)

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_int(name: str, value, low: int, high: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bounds = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {bounds}, got {value}")
