"""One sequence as the engine tracks it: its tokens and where their K/V lives."""
from itertools import count

import torch

from nanopaged.sampling_params import SamplingParams


class Sequence:
    """A prompt and one completion of it.

    `block_table[i]` is the KV-cache block holding tokens `[i*block_size, (i+1)*block_size)`.
    `num_computed_tokens` counts the leading tokens whose K/V the scheduled steps have computed
    (or are computing); the model still has to run over the rest. `num_cached_tokens` is how
    many prompt tokens the prefix cache served at admission.

    A request for `n` samples has n sequences, `index` 0 to n-1. Only sample 0 is queued: the
    others wait in its `forks` until the step that ends its prompt, then share its blocks.
    A seeded sequence draws its random numbers from its own `generator`.
    """
    _ids = count()

    def __init__(self, token_ids: list[int], sampling_params: SamplingParams, block_size: int,
                 stop_token_ids: frozenset[int] = frozenset(), request_id: str = "",
                 index: int = 0):
        self.seq_id = next(Sequence._ids)
        self.request_id = request_id
        self.index = index
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.sampling_params = sampling_params
        self.stop_token_ids = stop_token_ids  # EOS (unless ignore_eos) and the request's own
        self.block_size = block_size
        self.block_table: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.forks: list[Sequence] = []
        self.finish_reason: str | None = None  # "stop", "length" or "abort"
        self.stop_reason: int | str | None = None  # the stop token id or stop string, if any
        self.grammar = None  # where a structured output is in its grammar (structured_outputs)
        self.generator: torch.Generator | None = None
        if sampling_params.seed is not None:
            # sample 0 is what n=1 gives; the others get their own, fixed, seeds
            seed = sampling_params.seed if index == 0 else hash((sampling_params.seed, index))
            self.generator = torch.Generator().manual_seed(seed)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_blocks(self) -> int:
        """Blocks needed to hold every token of the sequence."""
        return (len(self.token_ids) + self.block_size - 1) // self.block_size

    def block_tokens(self, i: int) -> list[int]:
        return self.token_ids[i * self.block_size:(i + 1) * self.block_size]
