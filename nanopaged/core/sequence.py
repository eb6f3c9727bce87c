"""A sequence as the engine tracks it: its tokens, its sampling, where its K/V lives."""

from dataclasses import dataclass
from itertools import count

# A token id a sequence holds for a token sampled by a step the host has launched but
# not yet read back (async scheduling): no block holding one is hashed.
PENDING = -1


def cdiv(a: int, b: int) -> int:
    """a / b rounded up: the blocks of b tokens that a tokens fill."""
    return -(-a // b)


@dataclass
class SamplingOptions:
    """How one sequence is sampled and how long it may grow: `temperature=0` is greedy
    decoding; a completion ends after `max_tokens` tokens (None: at `max_model_len`; 0:
    once its prompt ran), or at a stop token. vLLM's `SamplingParams` extends these."""

    temperature: float = 1.0
    max_tokens: int | None = 16


class Sequence:
    """A prompt and one completion of it. `block_table[i]` is the KV-cache block holding
    tokens `[i*block_size, (i+1)*block_size)`. `num_computed_tokens` counts the leading
    tokens whose K/V the scheduled steps have computed (or are computing).
    `num_cached_tokens` is how many prompt tokens the prefix cache served. Seams, all
    off until the layer above sets them: `spans` are [first, end) ranges of the prompt
    that no chunk of a prefill may cut (an image whose tokens see each other, Gemma
    3's); `stop_token_ids` end the completion (EOS);
    `logits_processors` and `seed` are for its sampler above the core (which changes its
    row's logits; which makes its samples independent of its batch); `prompt_logits`
    asks for the logits of the prompt tokens it runs (logprobs), `hidden_states` for the
    step's hidden states (pooling); `cache_salt` starts the hash chain of its blocks
    (see `hash_block`): sequences with other salts share none (a LoRA adapter's K/V
    differs from the base model's)."""

    _ids = count()

    def __init__(self, token_ids: list[int], sampling_params: SamplingOptions):
        self.seq_id = next(Sequence._ids)
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.sampling_params = sampling_params
        self.spans: list[tuple[int, int]] = []
        self.stop_token_ids: frozenset[int] = frozenset()
        self.logits_processors: list = []
        self.seed: int | None = None
        self.prompt_logits = False
        self.hidden_states = False
        self.cache_salt: int | None = None
        self.block_table: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.finish_reason: str | None = None  # "stop", "length" or "abort"

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]
