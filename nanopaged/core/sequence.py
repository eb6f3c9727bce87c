"""One sequence as the engine tracks it: its tokens, and where their K/V lives."""
from itertools import count

from nanopaged.core.sampling_params import SamplingParams


class Sequence:
    """A prompt and one completion of it. `block_table[i]` is the KV-cache block holding tokens
    `[i*block_size, (i+1)*block_size)`. `num_computed_tokens` counts the leading tokens whose K/V
    the scheduled steps have computed (or are computing). `num_cached_tokens` is how many prompt
    tokens the prefix cache served. Seams, all off by default: `stop_token_ids` end the completion
    (EOS); `logits_processors` change its row's logits (see `Sampler`); `seed` makes its samples
    independent of its batch; `prompt_logits` asks for the logits of the prompt tokens it runs (for
    their logprobs)."""
    _ids = count()

    def __init__(self, token_ids: list[int], sampling_params: SamplingParams,
                 stop_token_ids: frozenset[int] = frozenset(), logits_processors: tuple = (),
                 seed: int | None = None, prompt_logits: bool = False):
        self.seq_id = next(Sequence._ids)
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.sampling_params, self.stop_token_ids = sampling_params, stop_token_ids
        self.logits_processors = list(logits_processors)
        self.seed, self.prompt_logits = seed, prompt_logits
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
        return self.token_ids[self.num_prompt_tokens:]
