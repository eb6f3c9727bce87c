"""Speculative decoding: propose a few tokens cheaply, verify them all in one forward of the
model, and keep the longest run it agrees with, plus one token of its own.

Proposals come from n-grams of the sequence itself (vLLM's "ngram" method: the tokens that
followed the latest earlier occurrence of the sequence's last n tokens) or from a small draft
model with the same tokenizer (vLLM's "draft_model"), proposing its most likely tokens. The
scheduler reserves cache slots for a sequence's token and its proposals (its lookahead slots);
the verifying step runs them as one query of k+1 tokens through the paged attention of any
backend, and `verify` accepts them: a greedy row while they are the target's argmax, a sampled
row by rejection sampling (Leviathan et al. 2023), which leaves every token's distribution
exactly the target's. `BlockManager.trim` then gives back the blocks reserved for rejected
proposals; only blocks whose every token was accepted enter the prefix cache.

The draft model keeps its own KV cache in the same blocks as the target's, at the same slots:
it runs every token the target runs (prompt chunks included), so that wherever the target's
cache holds a token, prefix hits included, the draft's holds it too.
"""
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch
from transformers import AutoConfig

from nanopaged.attention import AttentionMetadata
from nanopaged.sampler import sample

if TYPE_CHECKING:
    from nanopaged.config import Config
    from nanopaged.model_runner import StepInputs
    from nanopaged.scheduler import ScheduledStep

DEFAULT_NGRAM = 5  # vLLM's prompt_lookup_min and _max when neither is given
OPTIONS = {"num_speculative_tokens", "method", "model", "prompt_lookup_min", "prompt_lookup_max",
           "disable_by_batch_size"}


@dataclass
class SpeculativeConfig:
    """vLLM's speculative_config: `{"method": "ngram", "num_speculative_tokens": k,
    "prompt_lookup_max": n, "prompt_lookup_min": m}`, or `{"model": DRAFT,
    "num_speculative_tokens": k}`. Above `disable_by_batch_size` running sequences, steps
    decode one token each."""
    num_speculative_tokens: int
    method: str = "ngram"
    model: str | None = None
    prompt_lookup_min: int = DEFAULT_NGRAM
    prompt_lookup_max: int = DEFAULT_NGRAM
    disable_by_batch_size: int | None = None
    draft_hf_config: object = None

    @classmethod
    def from_dict(cls, options: dict, config: "Config") -> "SpeculativeConfig":
        """Checks vLLM's options against the engine's; a ValueError names what is wrong."""
        unknown = set(options) - OPTIONS
        if unknown:
            raise ValueError(f"speculative_config takes {', '.join(sorted(OPTIONS))}; got "
                             f"{', '.join(sorted(unknown))}")
        options = dict(options)
        k = options.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"speculative_config needs num_speculative_tokens >= 1, got {k!r}")
        method = options.setdefault("method", "draft_model" if options.get("model") else "ngram")
        if method not in ("ngram", "draft_model"):
            raise ValueError(f"speculative_config method must be 'ngram' or 'draft_model' (a "
                             f"draft model with the same tokenizer), got {method!r}")
        if (method == "draft_model") != isinstance(options.get("model"), str):
            raise ValueError("speculative_config: a draft model is named with 'model' (and "
                             "only with method 'draft_model')")
        low, high = options.get("prompt_lookup_min"), options.get("prompt_lookup_max")
        options["prompt_lookup_min"] = low = low or high or DEFAULT_NGRAM
        options["prompt_lookup_max"] = high = high or low
        disable = options.get("disable_by_batch_size")
        if not 1 <= low <= high or disable is not None and disable < 1:
            raise ValueError(f"speculative_config needs 1 <= prompt_lookup_min <= "
                             f"prompt_lookup_max and disable_by_batch_size >= 1; got {low}, "
                             f"{high}, {disable}")
        spec = cls(**options)
        if method == "draft_model":
            spec.model, spec.draft_hf_config = _check_draft(spec.model, config)
        return spec


def _check_draft(model: str, config: "Config") -> tuple[str, object]:
    from nanopaged.config import resolve_model
    from nanopaged.model import check_supported
    path = resolve_model(model)
    draft = AutoConfig.from_pretrained(path)
    check_supported(draft)
    if draft.vocab_size != config.hf_config.vocab_size:
        raise ValueError(f"the draft model's vocabulary ({draft.vocab_size} tokens) is not the "
                         f"model's ({config.hf_config.vocab_size}): it needs the same tokenizer")
    if draft.max_position_embeddings < config.max_model_len:
        raise ValueError(f"the draft model takes {draft.max_position_embeddings} positions, "
                         f"fewer than max_model_len={config.max_model_len}")
    if config.tensor_parallel_size > 1:
        raise ValueError("a draft model runs with tensor_parallel_size=1 only (the ngram "
                         "method works with any)")
    return path, draft


def ngram_proposals(token_ids: list[int], k: int, shortest: int, longest: int) -> list[int]:
    """k tokens (or none): those that followed the latest earlier occurrence of the sequence's
    last n tokens, for the largest n in [shortest, longest] that occurred before; where they
    run into the sequence's end, the repetition they are part of continues."""
    reverse = token_ids[::-1]  # the sequence's end first: list.index then searches backwards
    longest = min(longest, len(reverse) - 1)
    best_length, best_start = 0, 0
    end = 0
    while best_length < longest:
        try:
            end = reverse.index(reverse[0], end + 1)
        except ValueError:
            break
        length = 1
        while length < longest and end + length < len(reverse) \
                and reverse[end + length] == reverse[length]:
            length += 1
        if length > best_length:
            best_length, best_start = length, len(reverse) - end
    if best_length < shortest:
        return []
    proposals = token_ids[best_start:best_start + k]
    while len(proposals) < k:  # past the sequence's end, the repetition goes on
        proposals.append(proposals[len(proposals) - (len(token_ids) - best_start)])
    return proposals


class NgramProposer:
    def __init__(self, config: SpeculativeConfig):
        self.shortest, self.longest = config.prompt_lookup_min, config.prompt_lookup_max

    def kv_bytes_per_block(self) -> int:
        return 0  # it keeps no cache

    def allocate_kv_cache(self, num_blocks: int) -> None:
        pass

    def propose(self, step: "ScheduledStep", inputs: "StepInputs") -> dict[int, list[int]]:
        """Per sequence of the step (by index) with lookahead slots, its proposals."""
        proposals = {}
        for i, k in step.lookahead_slots.items():
            tokens = ngram_proposals(step.seqs[i].token_ids, k, self.shortest, self.longest)
            if tokens:
                proposals[i] = tokens
        return proposals


class DraftProposer:
    """A smaller model proposing its greedy continuation, run eagerly beside the target."""

    def __init__(self, config: "Config", spec: SpeculativeConfig, device: torch.device,
                 device_inputs: Callable):
        from nanopaged.loader import load_model
        self.model = load_model(spec.model, spec.draft_hf_config, config.dtype, device,
                                config.attention_backend)
        self.config, self.device, self.device_inputs = config, device, device_inputs
        self.block_size = config.kvcache_block_size

    def kv_bytes_per_block(self) -> int:
        return self.model.kv_bytes_per_block(self.block_size, self.config.dtype)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.kv_cache = None  # free the old one first
        self.kv_cache = self.model.allocate_kv_cache(num_blocks, self.block_size,
                                                     self.config.dtype, self.device)

    def propose(self, step: "ScheduledStep", inputs: "StepInputs") -> dict[int, list[int]]:
        """Runs the step's tokens through the draft (writing its K/V), then, for the sequences
        with lookahead slots, one more forward per slot: each writes the K/V of the token
        proposed last and proposes the next (the last proposal is not verified)."""
        if len(inputs.block_copies):
            source, destination = torch.as_tensor(inputs.block_copies, device=self.device).T
            self.kv_cache[:, :, destination] = self.kv_cache[:, :, source]
        hidden = self.model(*self.device_inputs(inputs))
        if not step.lookahead_slots:
            return {}
        index = list(step.lookahead_slots)
        rows = inputs.cu_seqlens_q[1:][index] - 1 if inputs.ragged else np.array(index)
        tokens = self._greedy(hidden[torch.as_tensor(rows, device=self.device)])
        ks = np.array(list(step.lookahead_slots.values()))
        positions = np.array([len(step.seqs[i]) for i in index])  # where the first proposal goes
        block_tables = inputs.block_tables[index]
        proposed = [tokens]
        for j in range(ks.max()):
            active = np.flatnonzero(ks > j)  # sequences with a slot for proposal j
            tables, pos = block_tables[active], positions[active] + j
            slots = tables[np.arange(len(active)), pos // self.block_size].astype(np.int64) \
                * self.block_size + pos % self.block_size
            meta = AttentionMetadata(
                ragged=False, slot_mapping=self._tensor(slots, torch.int64),
                context_lens=self._tensor(pos + 1, torch.int32),
                block_tables=self._tensor(tables, torch.int32), max_seqlen_k=int(pos.max()) + 1)
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


def make_proposer(config: "Config", device: torch.device, device_inputs: Callable):
    spec = config.speculative
    if spec.method == "ngram":
        return NgramProposer(spec)
    return DraftProposer(config, spec, device, device_inputs)


def verify(logits: torch.Tensor, temperatures: torch.Tensor | None,
           proposals: list[list[int]], uniform: torch.Tensor) -> list[list[int]]:
    """The tokens each sequence emits. Its rows of `logits` (R, V), consecutive, score its last
    token and then each of its proposals; `temperatures` (R,) (None: all greedy) and the
    two uniform numbers per row (R, 2) are the sampler's. A proposal x is accepted with
    probability p(x) under the row's distribution p (greedy: when it is p's argmax); the first
    rejected one is replaced by a sample of p without x, renormalised (greedy: the argmax);
    when all are accepted, the last row adds a sample of its own."""
    drafted = torch.tensor([t for tokens in proposals for t in [*tokens, -1]],
                           device=logits.device)
    proposed = drafted >= 0
    x = drafted.clamp(min=0).unsqueeze(1)
    if temperatures is None:
        replacement = logits.argmax(dim=-1)
        accepted = replacement == drafted
    else:
        logits = logits.float()
        tempered = (logits - logits.amax(dim=-1, keepdim=True)) \
            / torch.where(temperatures > 0, temperatures, 1.0).unsqueeze(1)
        p_x = tempered.softmax(dim=-1).gather(1, x).squeeze(1)
        accepted = torch.where(temperatures > 0, uniform[:, 0] < p_x,
                               logits.argmax(dim=-1) == drafted) & proposed
        residual = tempered.scatter(1, x, torch.where(proposed, float("-inf"), tempered.gather(
            1, x).squeeze(1)).unsqueeze(1))
        replacement = sample(residual, (temperatures > 0).float(), uniform[:, 1])
    accepted, replacement = accepted.tolist(), replacement.tolist()
    emitted, row = [], 0
    for tokens in proposals:
        n = 0
        while n < len(tokens) and accepted[row + n]:
            n += 1
        emitted.append([*tokens[:n], replacement[row + n]])
        row += len(tokens) + 1
    return emitted
