"""One request as the engine tracks it: its tokens and where their KV lives."""
from enum import Enum, auto
from itertools import count

from nanopaged.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """A prompt and its completion so far.

    `block_table[i]` is the KV-cache block holding tokens `[i*block_size, (i+1)*block_size)`.
    `num_computed_tokens` counts the leading tokens whose K/V are already in those blocks;
    the model still has to run over the rest. `num_cached_tokens` is how many prompt tokens
    the prefix cache served at admission.
    """
    _ids = count()

    def __init__(self, token_ids: list[int], sampling_params: SamplingParams, block_size: int):
        self.seq_id = next(Sequence._ids)
        self.status = SequenceStatus.WAITING
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.sampling_params = sampling_params
        self.block_size = block_size
        self.block_table: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.num_scheduled_tokens = 0  # tokens the current step runs the model over
        self.finish_reason: str | None = None

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

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    @property
    def samples_this_step(self) -> bool:
        """Whether the current step reaches the last token, so the model samples the next one."""
        return self.num_computed_tokens + self.num_scheduled_tokens == len(self.token_ids)
