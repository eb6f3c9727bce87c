"""A step as a value that flows one way: the scheduler decides a `ScheduledStep`, the
runner turns it into `StepInputs`, runs them, and the engine applies the output."""

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from nanopaged.core.sequence import Sequence


@dataclass
class ScheduledStep:
    """One step as the scheduler decided it. The model runs `num_tokens[i]` tokens of
    `seqs[i]`, from position `starts[i]`. A sequence whose tokens reach its last token
    samples the next one: it is one of `sampling_seqs`, and `sampling_indices` holds
    its index in `seqs`. A row is one token's place in the step (in its inputs, its
    hidden states; the logits hold the rows that sample, and the prompt rows whose
    logits are asked for). A step in which every sequence runs its last token and
    samples is a decode step; any other is `ragged` (it holds prompt chunks), and
    attention takes another path for it. `preempted` lists the sequences preempted to
    make room for this step (they may run in it again, recomputed from their start).

    The last four fields serve features above the core, and stay empty without them:

    - `ended`: sequences whose prompt ran in this step but that sample nothing
      (`max_tokens=0`: a pooling request, or prompt logprobs only); they end with it.
    - `hidden_states`: true when a sequence asks for the model's last hidden states
      (pooling).
    - `prompt_logit_counts`: for prompt logprobs, `(i, n)` for each sequence (by
      index) that asks for its prompt's logits: it runs `n` tokens in this step whose
      next token is a prompt token.
    - `proposals`: speculative decoding's proposed tokens, by the index of their
      sequence: they run after its last token, in slots reserved for them, and each of
      them is sampled too."""

    seqs: list[Sequence] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    sampling_seqs: list[Sequence] = field(default_factory=list)
    sampling_indices: list[int] = field(default_factory=list)
    ragged: bool = False
    preempted: list[Sequence] = field(default_factory=list)
    ended: list[Sequence] = field(default_factory=list)
    hidden_states: bool = False
    prompt_logit_counts: list[tuple[int, int]] = field(default_factory=list)
    proposals: dict[int, list[int]] = field(default_factory=dict)

    def add(self, seq: Sequence, num_tokens: int) -> None:
        """Runs `num_tokens` more tokens of `seq`, sampling if they reach its last."""
        start = seq.num_computed_tokens
        self.seqs.append(seq)
        self.starts.append(start)
        self.num_tokens.append(num_tokens)
        last = start + num_tokens == len(seq)
        sampled = last and seq.sampling_params.max_tokens != 0
        self.ragged = self.ragged or num_tokens != 1 or not sampled
        self.hidden_states = self.hidden_states or seq.hidden_states
        if seq.prompt_logits and start + 1 < seq.num_prompt_tokens:
            n = min(start + num_tokens, seq.num_prompt_tokens - 1) - start
            self.prompt_logit_counts.append((len(self.seqs) - 1, n))
        if sampled:
            self.sampling_seqs.append(seq)
            self.sampling_indices.append(len(self.seqs) - 1)
        elif last:
            self.ended.append(seq)

    def add_decodes(self, seqs: list[Sequence]) -> None:
        """Runs the last token of each of `seqs` (whose K/V it does not hold yet)."""
        first = len(self.seqs)
        self.seqs += seqs
        self.starts += [len(seq.token_ids) - 1 for seq in seqs]
        self.num_tokens += [1] * len(seqs)
        self.sampling_seqs += seqs
        self.sampling_indices += range(first, first + len(seqs))

    @property
    def num_scheduled_tokens(self) -> int:
        """The tokens the model runs in this step, proposals included."""
        return sum(self.num_tokens) + sum(map(len, self.proposals.values()))

    @property
    def sample_counts(self) -> list[int]:
        """The tokens each sampling sequence samples: one, and one after each of its
        proposals (speculative decoding's; one each without it)."""
        return [1 + len(self.proposals.get(i, ())) for i in self.sampling_indices]

    @property
    def first_logit_rows(self) -> list[int]:
        """Each sampling sequence's first row of logits: its tokens take `sample_counts`
        rows (each row's own index without speculative decoding)."""
        return list(itertools.accumulate(self.sample_counts[:-1], initial=0))


@dataclass
class StepInputs:
    """One step's model inputs as host arrays (what tensor parallelism sends to other
    ranks). `logits_indices` picks the rows whose logits are computed: the sampling
    rows, then those of `ScheduledStep.prompt_logit_counts`. Ragged steps (prompt
    chunks) fill the `cu_seqlens`. `extension` is what the runner's extension adds
    (LoRA's adapter slots, a step's images): it travels to every rank with the
    rest."""

    ragged: bool
    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    context_lens: np.ndarray
    block_tables: np.ndarray
    logits_indices: np.ndarray
    cu_seqlens_q: np.ndarray | None = None
    cu_seqlens_k: np.ndarray | None = None
    max_seqlen_q: int = 1
    extension: object = None


@dataclass
class SamplerOutput:
    """What a step sampled, one entry per sampling sequence (the step's
    `sampling_seqs`, in order): its new tokens (one, and one after each of its
    proposals; once applied, the proposals the model agreed with and one more).
    `logits` holds the model's logits (before any processor or temperature) that the
    tokens came from: row `step.first_logit_rows[i] + j` for token j of sampling
    sequence i; then those of the step's `prompt_logit_counts`, in order, row j of
    sequence i predicting its token after position `step.starts[i] + j`.
    `hidden_states` (when the step's do): each token's last hidden state, sequence by
    sequence, proposals last; valid until the next step."""

    token_ids: list[list[int]]
    logits: torch.Tensor | None = None
    hidden_states: torch.Tensor | None = None


@dataclass(eq=False)  # each one itself: a key of its own
class Launched:
    """A step the runner started (`ModelRunner.launch`) and has not yet read back: its
    inputs, the sequence each token it samples goes to (`token_seqs`) and the token's
    random number, and what the device computes for it (on a GPU, tensors still being
    computed): the sampled tokens (and their copy on the host, done once `copied` is),
    the logits, the hidden states."""

    step: ScheduledStep
    inputs: StepInputs
    token_seqs: list[Sequence]
    uniform: torch.Tensor | None
    tokens: torch.Tensor | None = None
    tokens_on_host: torch.Tensor | None = None
    copied: torch.cuda.Event | None = None
    logits: torch.Tensor | None = None
    hidden: torch.Tensor | None = None


@dataclass
class Pending:
    """Input ids a step takes from an earlier launched step's samples, on the device:
    input row `input_rows[i]` gets that step's sampled token `token_indices[i]`."""

    launched: Launched
    input_rows: list[int]
    token_indices: list[int]
