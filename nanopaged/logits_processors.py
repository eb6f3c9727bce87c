"""What a request may ask of the logits before they are sampled, applied as vLLM applies it.

In order: only `allowed_token_ids` may be sampled; a `bad_words` entry may not be completed;
`logit_bias` is added; the repetition penalty (tokens of the prompt and the completion), then
the frequency and presence penalties (tokens of the completion) are applied. `min_p` comes
later, beside top-k and top-p, on the tempered distribution (see the sampler). Each step works
on the rows that ask for any of this, as batched tensor ops; a batch whose requests ask for
none never calls it.
"""
import torch
from transformers import PreTrainedTokenizerBase

from nanopaged.sampling_params import LOGIT_BIAS_LIMIT, SamplingParams
from nanopaged.sequence import Sequence


def bad_words_token_ids(params: SamplingParams, tokenizer: PreTrainedTokenizerBase
                        ) -> list[list[int]]:
    """Each bad word's token ids, at the start of a text and after a space (as vLLM: a word
    is banned in both places), without special tokens."""
    variants = []
    for word in params.bad_words or ():
        for text in dict.fromkeys((word.lstrip(), " " + word.lstrip())):
            token_ids = tokenizer.encode(text, add_special_tokens=False)
            if token_ids and token_ids not in variants:
                variants.append(token_ids)
    return variants


def adjust_logits(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """logits: (B, V), a row per sequence of `seqs` -> float32 logits with each row adjusted
    as its request asks (the rows that ask nothing are returned as they were)."""
    rows = [i for i, seq in enumerate(seqs) if seq.sampling_params.adjusts_logits]
    logits = logits.float().clone()
    subset = [seqs[i] for i in rows]
    index = torch.tensor(rows, device=logits.device)
    adjusted = logits[index]  # (R, V)
    _mask_tokens(adjusted, subset)
    for r, seq in enumerate(subset):
        for token_id, bias in (seq.sampling_params.logit_bias or {}).items():
            adjusted[r, token_id] += max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, bias))
    if any(_penalized(seq.sampling_params) for seq in subset):
        _apply_penalties(adjusted, subset)
    logits[index] = adjusted
    return logits


def _mask_tokens(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Forbids, in place, the tokens each row may not sample: all but its allowed token ids,
    and the last token of each bad word whose other tokens end the completion."""
    forbidden = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
    for r, seq in enumerate(seqs):
        params, completion = seq.sampling_params, seq.completion_token_ids
        if params.allowed_token_ids:
            forbidden[r] = True
            forbidden[r, list(params.allowed_token_ids)] = False
        for word in params.bad_words_token_ids or ():
            if len(word) == 1 or completion[len(completion) - len(word) + 1:] == word[:-1]:
                forbidden[r, word[-1]] = True
    logits.masked_fill_(forbidden, float("-inf"))


def _penalized(params: SamplingParams) -> bool:
    return bool(params.repetition_penalty != 1.0 or params.frequency_penalty
                or params.presence_penalty)


def _apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """vLLM's penalties, in place: logits (R, V)."""
    device, vocab_size = logits.device, logits.shape[1]
    completion_counts = _token_counts([s.completion_token_ids for s in seqs], vocab_size, device)
    prompt_counts = _token_counts([s.token_ids[:s.num_prompt_tokens] for s in seqs], vocab_size,
                                  device)
    params = [seq.sampling_params for seq in seqs]
    repetition, frequency, presence = (
        torch.tensor([getattr(p, name) for p in params], device=device).unsqueeze(1)
        for name in ("repetition_penalty", "frequency_penalty", "presence_penalty"))
    seen = (prompt_counts + completion_counts) > 0
    penalty = torch.where(seen, repetition, 1.0)
    logits.copy_(torch.where(logits > 0, logits / penalty, logits * penalty))
    logits -= frequency * completion_counts + presence * (completion_counts > 0)


def _token_counts(token_lists: list[list[int]], vocab_size: int,
                  device: torch.device) -> torch.Tensor:
    """(R, V) float32: how often each token occurs in each row's list."""
    longest = max(map(len, token_lists), default=0)
    # padding counts in an extra column, dropped at the end
    padded = torch.full((len(token_lists), longest), vocab_size, dtype=torch.int64)
    for r, token_ids in enumerate(token_lists):
        padded[r, :len(token_ids)] = torch.tensor(token_ids, dtype=torch.int64)
    counts = torch.zeros(len(token_lists), vocab_size + 1, device=device)
    counts.scatter_add_(1, padded.to(device), torch.ones(padded.shape, device=device))
    return counts[:, :vocab_size]
