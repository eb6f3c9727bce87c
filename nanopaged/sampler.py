"""Turns the logits of the sampling rows into next tokens: greedy, temperature, top-k, top-p."""
from dataclasses import dataclass

import torch

from nanopaged.layers import cuda_compiled
from nanopaged.sampling_params import SamplingParams
from nanopaged.sequence import Sequence


@cuda_compiled
def sample(logits: torch.Tensor, temperatures: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Per row, the first token whose cumulative probability under softmax(logits / T) exceeds
    `uniform` (in [0, 1)), or argmax(logits) where T is 0."""
    logits = logits.float()
    shifted = logits - logits.amax(dim=-1, keepdim=True)  # <= 0, so a tiny T cannot overflow
    sampling = temperatures > 0
    probs = torch.softmax(shifted / torch.where(sampling, temperatures, 1.0).unsqueeze(1), dim=-1)
    cdf = probs.cumsum(dim=-1)
    sampled = torch.searchsorted(cdf, uniform.unsqueeze(1) * cdf[:, -1:], right=True).squeeze(1)
    return torch.where(sampling, sampled.clamp(max=logits.shape[-1] - 1), logits.argmax(dim=-1))


@dataclass
class TokenLogprobs:
    """The log-probability and 1-based rank of a sampled token, and the most likely tokens'."""
    logprob: float
    rank: int
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass
class SamplerOutput:
    """What a step sampled, one entry per sampling row (the step's `samplers`, in order): the
    row's new token ids and, if its request asked for them, their logprobs."""
    token_ids: list[list[int]]
    logprobs: list[list[TokenLogprobs] | None]


class Sampler:
    """Samples one token per row of logits, each row with its own sequence's settings.

    Sampling inverts the cumulative distribution at one uniform number per row (a vocabulary's
    worth of random noise per row would cost more than the rest of a CPU step). A seeded
    sequence draws its number from its own generator, so its samples do not depend on what else
    shares the batch. Until a sequence has `min_tokens` tokens, the tokens that would stop it
    cannot be sampled.
    """

    def __init__(self, device: torch.device):
        self.device = device

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        # logits: (B, V), one row per sequence in `seqs`
        raw_logits = logits
        logits = self._mask_stop_tokens(logits, seqs)
        params = [seq.sampling_params for seq in seqs]
        if all(p.temperature == 0 for p in params):
            tokens = logits.argmax(dim=-1)
        else:
            temperatures = self._to_device([float(p.temperature) for p in params])
            if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
                # filter the tempered distribution; the rows are then sampled at temperature 1
                logits = logits.float()
                shifted = logits - logits.amax(dim=-1, keepdim=True)
                tempered = shifted / torch.where(temperatures > 0, temperatures, 1.0).unsqueeze(1)
                logits = self._top_k_top_p(tempered, params)
                temperatures = (temperatures > 0).float()
            tokens = sample(logits, temperatures, self._uniform(seqs))
        token_ids = tokens.view(-1, 1).tolist()
        return SamplerOutput(token_ids, self._logprobs(raw_logits, tokens, seqs))

    def _uniform(self, seqs: list[Sequence]) -> torch.Tensor:
        """One uniform number per row: a seeded row's from its own generator."""
        uniform = torch.rand(len(seqs))
        for i, seq in enumerate(seqs):
            if seq.generator is not None:
                uniform[i] = torch.rand(1, generator=seq.generator)[0]
        return self._to_device(uniform)

    def _mask_stop_tokens(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        rows, cols = [], []
        for i, seq in enumerate(seqs):
            if seq.num_completion_tokens < seq.sampling_params.min_tokens:
                rows += [i] * len(seq.stop_token_ids)
                cols += seq.stop_token_ids
        if not rows:
            return logits
        logits = logits.clone()
        logits[self._to_device(rows), self._to_device(cols)] = float("-inf")
        return logits

    def _logprobs(self, logits: torch.Tensor, tokens: torch.Tensor, seqs: list[Sequence]
                  ) -> list[list[TokenLogprobs] | None]:
        """For the rows that asked for them, the log-softmax of the model's own logits."""
        rows = [i for i, seq in enumerate(seqs) if seq.sampling_params.logprobs is not None]
        result: list[list[TokenLogprobs] | None] = [None] * len(seqs)
        if not rows:
            return result
        index = self._to_device(rows)
        logprobs = logits[index].float().log_softmax(dim=-1)               # (R, V)
        chosen = logprobs.gather(1, tokens[index].unsqueeze(1))             # (R, 1)
        ranks = (logprobs > chosen).sum(dim=-1) + 1
        top = logprobs.topk(max(seqs[i].sampling_params.logprobs for i in rows), dim=-1)
        columns = zip(chosen[:, 0].tolist(), ranks.tolist(), top.indices.tolist(),
                      top.values.tolist())
        for i, (logprob, rank, top_ids, top_logprobs) in zip(rows, columns):
            k = seqs[i].sampling_params.logprobs
            result[i] = [TokenLogprobs(logprob, rank, top_ids[:k], top_logprobs[:k])]
        return result

    def _top_k_top_p(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        vocab_size = logits.shape[-1]
        top_k = self._to_device([min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size
                                 for p in params])
        top_p = self._to_device([float(p.top_p) for p in params])
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        rank = torch.arange(vocab_size, device=self.device)
        drop = rank.unsqueeze(0) >= top_k.unsqueeze(1)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # drop a token when the tokens ranked above it already hold top_p of the mass
        drop |= (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p.unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        return torch.empty_like(logits).scatter_(1, order, sorted_logits)

    def _to_device(self, values: list | torch.Tensor) -> torch.Tensor:
        # from pinned memory: a copy from pageable memory would first wait for the GPU to finish
        # the model's forward, and only then could the sampler's kernels be queued
        if self.device.type != "cuda":
            return torch.as_tensor(values)
        return torch.as_tensor(values).pin_memory().to(self.device, non_blocking=True)
