"""One sequence as the engine tracks it: its tokens and where their K/V lives."""
from itertools import count

from nanopaged.sampling_params import SamplingParams


class Sequence:
    """A prompt and one completion of it.

    `block_table[i]` is the KV-cache block holding tokens `[i*block_size, (i+1)*block_size)`.
    `num_computed_tokens` counts the leading tokens whose K/V are already in those blocks;
    the model still has to run over the rest. `num_cached_tokens` is how many prompt tokens
    the prefix cache served at admission.

    A request for `n` samples has n sequences, `index` 0 to n-1. Only sample 0 is queued: the
    others wait in its `forks` until its prompt is prefilled, then share its blocks.
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
        self.num_scheduled_tokens = 0  # tokens the current step runs the model over
        self.forks: list[Sequence] = []
        self.finish_reason: str | None = None  # "stop" or "length"
        self.stop_reason: int | str | None = None  # the stop token id or stop string, if any

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

    @property
    def samples_this_step(self) -> bool:
        """Whether the current step reaches the last token, so the model samples the next one."""
        return self.num_computed_tokens + self.num_scheduled_tokens == len(self.token_ids)

    @property
    def samplers(self) -> list["Sequence"]:
        """The sequences that sample from this one's logits this step: itself and, on the step
        that ends its prompt, its forks."""
        return [self, *self.forks]
