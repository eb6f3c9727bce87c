"""What vLLM's SamplingParams may ask of the logits before sampling, as one kind of the
core's logits processors (see `Sampler`), applied as vLLM applies it.

In order: only `allowed_token_ids` may be sampled; a `bad_words` entry may not be
completed; `logit_bias` is added; the repetition penalty (tokens of the prompt and the
completion), then the frequency and presence penalties (tokens of the completion) are
applied; and until a completion has `min_tokens` tokens, the tokens that would stop it
cannot be sampled. Each step works on the rows that ask for any of this, as batched
tensor ops; a sequence that asks for none carries no processor, and a batch of such
sequences costs nothing.
"""

import torch
from transformers import PreTrainedTokenizerBase

from nanopaged.core.sequence import Sequence
from nanopaged.sampling_params import LOGIT_BIAS_LIMIT, SamplingParams


class SamplingAdjustments:
    """The adjustments one sequence's SamplingParams ask for (`wanted` says whether
    any)."""

    def __init__(self, params: SamplingParams, tokenizer: PreTrainedTokenizerBase):
        self.params = params
        self.bad_words = bad_words_token_ids(params, tokenizer)

    @staticmethod
    def wanted(params: SamplingParams) -> bool:
        return bool(
            params.presence_penalty
            or params.frequency_penalty
            or params.min_tokens
            or params.repetition_penalty != 1.0
            or params.logit_bias
            or params.allowed_token_ids
            or params.bad_words
        )

    @classmethod
    def apply(
        cls,
        logits: torch.Tensor,
        processors: list["SamplingAdjustments"],
        seqs: list[Sequence],
    ) -> torch.Tensor:
        """logits (R, V) float32, a row per sequence, adjusted in place and returned."""
        _mask_tokens(logits, processors, seqs)
        for r, processor in enumerate(processors):
            for token_id, bias in (processor.params.logit_bias or {}).items():
                logits[r, token_id] += max(
                    -LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, bias)
                )
        penalized = [r for r, p in enumerate(processors) if _penalized(p.params)]
        if penalized:
            index = torch.tensor(penalized, device=logits.device)
            logits[index] = _penalties(
                logits[index],
                [processors[r].params for r in penalized],
                [seqs[r] for r in penalized],
            )
        return logits


def bad_words_token_ids(
    params: SamplingParams, tokenizer: PreTrainedTokenizerBase
) -> list[list[int]]:
    """Each bad word's token ids, at the start of a text and after a space (as vLLM: a
    word is banned in both places), without special tokens."""
    variants = []
    for word in params.bad_words or ():
        for text in dict.fromkeys((word.lstrip(), " " + word.lstrip())):
            token_ids = tokenizer.encode(text, add_special_tokens=False)
            if token_ids and token_ids not in variants:
                variants.append(token_ids)
    return variants


def _mask_tokens(
    logits: torch.Tensor, processors: list[SamplingAdjustments], seqs: list[Sequence]
) -> None:
    """Forbids, in place, the tokens each row may not sample: all but its allowed token
    ids, the last token of each bad word whose other tokens end the completion, and the
    tokens that would stop the completion before its min_tokens."""
    forbidden = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
    for r, (processor, seq) in enumerate(zip(processors, seqs)):
        params, completion = processor.params, seq.completion_token_ids
        if params.allowed_token_ids:
            forbidden[r] = True
            forbidden[r, list(params.allowed_token_ids)] = False
        for word in processor.bad_words:
            if (
                len(word) == 1
                or completion[len(completion) - len(word) + 1 :] == word[:-1]
            ):
                forbidden[r, word[-1]] = True
        if len(completion) < params.min_tokens:
            forbidden[r, list(seq.stop_token_ids)] = True
    logits.masked_fill_(forbidden, float("-inf"))


def _penalized(params: SamplingParams) -> bool:
    return bool(
        params.repetition_penalty != 1.0
        or params.frequency_penalty
        or params.presence_penalty
    )


def _penalties(
    logits: torch.Tensor, params: list[SamplingParams], seqs: list[Sequence]
) -> torch.Tensor:
    """vLLM's penalties: logits (R, V)."""
    device, vocab_size = logits.device, logits.shape[1]
    completion_counts = _token_counts(
        [s.completion_token_ids for s in seqs], vocab_size, device
    )
    prompt_counts = _token_counts(
        [s.token_ids[: s.num_prompt_tokens] for s in seqs], vocab_size, device
    )
    repetition, frequency, presence = (
        torch.tensor([getattr(p, name) for p in params], device=device).unsqueeze(1)
        for name in ("repetition_penalty", "frequency_penalty", "presence_penalty")
    )
    seen = (prompt_counts + completion_counts) > 0
    penalty = torch.where(seen, repetition, 1.0)
    logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    return logits - frequency * completion_counts - presence * (completion_counts > 0)


def _token_counts(
    token_lists: list[list[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """(R, V) float32: how often each token occurs in each row's list."""
    longest = max(map(len, token_lists), default=0)
    # padding counts in an extra column, dropped at the end
    padded = torch.full((len(token_lists), longest), vocab_size, dtype=torch.int64)
    for r, token_ids in enumerate(token_lists):
        # an id past the vocabulary (an image's pad id) counts with the padding
        ids = torch.tensor(token_ids, dtype=torch.int64).clamp(max=vocab_size)
        padded[r, : len(token_ids)] = ids
    counts = torch.zeros(len(token_lists), vocab_size + 1, device=device)
    counts.scatter_add_(1, padded.to(device), torch.ones(padded.shape, device=device))
    return counts[:, :vocab_size]
