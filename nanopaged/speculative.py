"""Speculative decoding: propose a few tokens cheaply, verify them all in one forward of
the model, and keep the run the model agrees with, plus one token of its own.

Proposals come from n-grams of the sequence itself (vLLM's "ngram" method: the tokens
that followed the latest earlier occurrence of the sequence's last n tokens) or from a
small draft model with the same tokenizer (vLLM's "draft_model"), proposing its most
likely tokens. This file reaches the core through the seam of `LLMEngineCore`, the two
ends of a step, which `SpeculativeEngine` extends: once a step is scheduled, each
decoding sequence gets cache slots past its last token (as many as the token budget and
the free blocks allow: a proposal never preempts) and proposals for them
(`ScheduledStep.proposals`); the runner runs a sequence's token and its proposals as one
query of k+1 tokens through the paged attention of any backend, and samples after each;
applying the step keeps the proposals while the model's own samples equal them. Both
proposers are deterministic, so this accepts a proposal x with probability p(x), as
rejection sampling would, and each token is still sampled from the model's distribution,
with a seeded sequence's numbers: speculative or not, a seeded request gives the same
tokens. `BlockManager.trim` then gives back the blocks reserved for rejected proposals;
only blocks whose every token was accepted enter the prefix cache.

The draft model keeps its own KV cache in the same blocks as the model's, at the same
slots: it runs every token the model runs (prompt chunks included), so that wherever the
model's cache holds a token, prefix hits included, the draft's holds it too.
"""

import math
from dataclasses import dataclass, fields, replace

import numpy as np
import torch

from nanopaged.checkpoint import read_checkpoint_config, resolve_model
from nanopaged.checks import check_fields
from nanopaged.core.attention import BACKENDS, AttentionMetadata
from nanopaged.core.config import Config
from nanopaged.core.llm_engine import LLMEngineCore
from nanopaged.core.loader import load_model
from nanopaged.core.model import sliding_window
from nanopaged.core.model_runner import ModelRunner, kv_block_bytes, new_kv_cache
from nanopaged.core.step import SamplerOutput, ScheduledStep

DEFAULT_NGRAM = 5  # vLLM's prompt_lookup_min and _max when neither is given


@dataclass
class SpeculativeConfig:
    """vLLM's speculative_config: `{"method": "ngram", "num_speculative_tokens": k,
    "prompt_lookup_max": n, "prompt_lookup_min": m}`, or `{"model": DRAFT,
    "num_speculative_tokens": k}`. Above `disable_by_batch_size` running sequences,
    steps decode one token each."""

    num_speculative_tokens: int
    method: str = "ngram"
    model: str | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    disable_by_batch_size: int | None = None

    @classmethod
    def from_dict(
        cls, options: dict, config: Config, tensor_parallel_size: int = 1
    ) -> "SpeculativeConfig":
        """Checks vLLM's options against the engine's; a ValueError names what is
        wrong."""
        names = [f.name for f in fields(cls)]
        if not isinstance(options, dict):
            raise ValueError(f"speculative_config must be a dict, got {options!r}")
        unknown = set(options) - set(names)
        if unknown:
            raise ValueError(
                f"speculative_config takes {', '.join(sorted(names))}; got "
                f"{', '.join(sorted(unknown))}"
            )
        if "num_speculative_tokens" not in options:
            raise ValueError("speculative_config needs num_speculative_tokens")
        spec = cls(**options)
        check_fields(
            spec,
            {"method": ("ngram", "draft_model")},
            (
                "num_speculative_tokens",
                "prompt_lookup_min",
                "prompt_lookup_max",
                "disable_by_batch_size",
            ),
        )
        if "method" not in options and spec.model is not None:
            spec.method = "draft_model"
        if (spec.method == "draft_model") != (spec.model is not None):
            raise ValueError(
                "speculative_config: a draft model is named with 'model' (and "
                "only with method 'draft_model')"
            )
        low, high = spec.prompt_lookup_min, spec.prompt_lookup_max
        spec.prompt_lookup_min = low = low or high or DEFAULT_NGRAM
        spec.prompt_lookup_max = high = high or low
        if low > high:
            raise ValueError(
                f"speculative_config needs prompt_lookup_min <= prompt_lookup_max, "
                f"got {low} > {high}"
            )
        if spec.method == "draft_model":
            spec.model = _check_draft(spec.model, config, tensor_parallel_size)
        return spec


def _check_draft(model: str, config: Config, tensor_parallel_size: int) -> str:
    path = resolve_model(model)
    draft = read_checkpoint_config(path)
    if draft.vocab_size != config.hf_config.vocab_size:
        raise ValueError(
            f"the draft model's vocabulary ({draft.vocab_size} tokens) is not the "
            f"model's ({config.hf_config.vocab_size}): it needs the same tokenizer"
        )
    if draft.max_position_embeddings < config.max_model_len:
        raise ValueError(
            f"the draft model takes {draft.max_position_embeddings} positions, "
            f"fewer than max_model_len={config.max_model_len}"
        )
    if tensor_parallel_size > 1:
        raise ValueError(
            "a draft model runs with tensor_parallel_size=1 only (the ngram "
            "method works with any)"
        )
    return path


def ngram_proposals(
    token_ids: list[int], k: int, shortest: int, longest: int
) -> list[int]:
    """k tokens (or none): those that followed the latest earlier occurrence of the
    sequence's last n tokens, for the largest n in [shortest, longest] that occurred
    before; where they run into the sequence's end, the repetition they are part of
    continues."""
    # the sequence's end first: list.index then searches backwards
    reverse = token_ids[::-1]
    longest = min(longest, len(reverse) - 1)
    best_length, best_start = 0, 0
    end = 0
    while best_length < longest:
        try:
            end = reverse.index(reverse[0], end + 1)
        except ValueError:
            break
        length = 1
        while (
            length < longest
            and end + length < len(reverse)
            and reverse[end + length] == reverse[length]
        ):
            length += 1
        if length > best_length:
            best_length, best_start = length, len(reverse) - end
    if best_length < shortest:
        return []
    proposals = token_ids[best_start : best_start + k]
    while len(proposals) < k:  # past the sequence's end, the repetition goes on
        proposals.append(proposals[len(proposals) - (len(token_ids) - best_start)])
    return proposals


class NgramProposer:
    """Proposes what followed the last n-gram before (see `ngram_proposals`); keeps no
    cache."""

    def __init__(self, spec: SpeculativeConfig):
        self.shortest = spec.prompt_lookup_min
        self.longest = spec.prompt_lookup_max

    def kv_bytes_per_block(self) -> int:
        return 0

    def allocate_kv_cache(self, num_blocks: int) -> None:
        pass

    def propose(
        self, step: ScheduledStep, slots: dict[int, int], runner: ModelRunner
    ) -> dict[int, list[int]]:
        """For each sequence of the step (by index) with `slots[i]` slots, its
        proposals."""
        proposals = {}
        for i, k in slots.items():
            tokens = ngram_proposals(
                step.seqs[i].token_ids, k, self.shortest, self.longest
            )
            if tokens:
                proposals[i] = tokens
        return proposals


class DraftProposer(NgramProposer):
    """A smaller model proposing its greedy continuation, run eagerly beside the
    model."""

    def __init__(self, spec: SpeculativeConfig, config: Config):
        super().__init__(spec)
        self.config = config
        self.device = torch.device(config.device)
        draft_config = read_checkpoint_config(spec.model)
        if _reach(draft_config) > _reach(config.hf_config):
            raise ValueError(
                f"the draft model {spec.model!r} attends further back than the "
                f"model's sliding window of {_reach(config.hf_config)} tokens, "
                f"whose older blocks are given back"
            )
        self.model = load_model(
            replace(config, model=spec.model, hf_config=draft_config), self.device
        )
        self.block_size = config.kvcache_block_size

    def kv_bytes_per_block(self) -> int:
        return kv_block_bytes(self.model, self.block_size, self.config.kv_cache_dtype)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.kv_cache = None  # free the old one first
        zeros = BACKENDS[self.config.attention_backend].zeros
        dtype = self.config.kv_cache_dtype
        self.kv_cache = new_kv_cache(
            self.model, num_blocks, self.block_size, dtype, self.device, zeros
        )

    @torch.inference_mode()
    def propose(
        self, step: ScheduledStep, slots: dict[int, int], runner: ModelRunner
    ) -> dict[int, list[int]]:
        """Runs the step's tokens through the draft (writing its K/V), then, for the
        sequences with slots, one more forward per slot: each writes the K/V of the
        token proposed last and proposes the next (the last proposal is not
        verified)."""
        inputs = runner.prepare_inputs(step)
        hidden = self.model(*runner.device_inputs(inputs))
        if not slots:
            return {}
        index = list(slots)
        rows = inputs.cu_seqlens_q[1:][index] - 1 if inputs.ragged else np.array(index)
        tokens = self._greedy(hidden[torch.as_tensor(rows, device=self.device)])
        ks = np.array(list(slots.values()))
        # where the first proposal goes
        positions = np.array([len(step.seqs[i]) for i in index])
        block_tables = inputs.block_tables[index]
        proposed = [tokens]
        for j in range(ks.max()):
            active = np.flatnonzero(ks > j)  # sequences with a slot for proposal j
            tables, pos = block_tables[active], positions[active] + j
            slot_mapping = (
                tables[np.arange(len(active)), pos // self.block_size].astype(np.int64)
                * self.block_size
                + pos % self.block_size
            )
            meta = AttentionMetadata(
                ragged=False,
                slot_mapping=self._tensor(slot_mapping, torch.int64),
                context_lens=self._tensor(pos + 1, torch.int32),
                block_tables=self._tensor(tables, torch.int32),
                max_seqlen_k=int(pos.max()) + 1,
            )
            ids = proposed[-1][self._tensor(active, torch.int64)] if j else proposed[-1]
            hidden = self.model(ids, self._tensor(pos, torch.int64), meta)
            if j + 1 < ks.max():
                full = torch.zeros(len(index), dtype=torch.int64, device=self.device)
                full[self._tensor(active, torch.int64)] = self._greedy(hidden)
                proposed.append(full)
        columns = torch.stack(proposed, dim=1).tolist()
        return {i: row[:k] for i, row, k in zip(index, columns, ks.tolist())}

    def _greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden).argmax(dim=-1)

    def _tensor(self, values: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.as_tensor(values, dtype=dtype, device=self.device)


class SpeculativeEngine(LLMEngineCore):
    """The core engine with proposals verified each step (see the module's docstring).
    Each decoding sequence (oldest first) gets slots for up to `num_speculative_tokens`
    proposals: as many as its max_tokens and max_model_len leave room for, the step's
    token budget allows and free blocks hold; none with logits processors (they may
    depend on each token), nor when a step decodes more than `disable_by_batch_size`
    sequences. Counts the sequences that got proposals (`num_drafts`), the tokens
    proposed and those accepted."""

    def __init__(
        self,
        config: Config,
        runner: ModelRunner,
        spec: SpeculativeConfig,
        proposer: NgramProposer,
    ):
        super().__init__(config, runner)
        self.spec = spec
        self.proposer = proposer
        proposer.allocate_kv_cache(self.runner.num_kvcache_blocks)
        self.reserved: list[int] = []  # the sequences (by index) given slots this step
        self.num_drafts = 0
        self.num_proposed_tokens = 0
        self.num_accepted_tokens = 0

    def schedule(self) -> ScheduledStep:
        step = super().schedule()
        slots = {}
        for i, k in self._room(step).items():
            k = self.block_manager.reserve(step.seqs[i], k)
            if k:
                slots[i] = k
        self.reserved = list(slots)
        if step.seqs:
            step.proposals = self.proposer.propose(step, slots, self.runner)
        self.num_drafts += len(step.proposals)
        self.num_proposed_tokens += sum(map(len, step.proposals.values()))
        return step

    def _room(self, step: ScheduledStep) -> dict[int, int]:
        """The proposals each decoding sequence of the step may get, before free
        blocks."""
        decoding = [
            i
            for i in step.sampling_indices
            if step.num_tokens[i] == 1 and step.seqs[i].num_completion_tokens > 0
        ]
        if len(decoding) > (self.spec.disable_by_batch_size or len(decoding)):
            return {}
        budget = self.config.max_num_batched_tokens - step.num_scheduled_tokens
        room = {}
        for i in decoding:
            seq = step.seqs[i]
            left = self.config.max_model_len - len(seq)
            if seq.sampling_params.max_tokens is not None:
                left = min(
                    left, seq.sampling_params.max_tokens - seq.num_completion_tokens
                )
            k = min(self.spec.num_speculative_tokens, left - 1, budget)
            if k > 0 and not seq.logits_processors:
                room[i] = k
                budget -= k
        return room

    def apply(self, step: ScheduledStep, sampled: SamplerOutput) -> SamplerOutput:
        """Keeps each row's proposals while the model sampled them, and the token after;
        gives back the slots of the rest."""
        kept = []
        for i, tokens in zip(step.sampling_indices, sampled.token_ids):
            proposals = step.proposals.get(i, ())
            accepted = 0
            while (
                accepted < min(len(proposals), len(tokens) - 1)
                and tokens[accepted] == proposals[accepted]
            ):
                accepted += 1
            kept.append(tokens[: accepted + 1])
            self.num_accepted_tokens += accepted
        applied = super().apply(step, SamplerOutput(kept, sampled.logits))
        for i in self.reserved:
            if step.seqs[i].finish_reason is None:
                self.block_manager.trim(step.seqs[i])
        return applied


def _reach(hf_config) -> float:
    """How far back the model's layers attend (inf: some layer, all the way)."""
    return max(
        sliding_window(hf_config, i) or math.inf
        for i in range(hf_config.num_hidden_layers)
    )


def make_proposer(spec: SpeculativeConfig, config: Config) -> NgramProposer:
    return (
        NgramProposer(spec) if spec.method == "ngram" else DraftProposer(spec, config)
    )
