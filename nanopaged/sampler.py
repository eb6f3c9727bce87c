"""Turns the logits of the sampling rows into next tokens: greedy, temperature, top-k, top-p,
min-p; and logprobs."""
from dataclasses import dataclass, field

import numpy as np
import torch

from nanopaged.layers import cuda_compiled
from nanopaged.logits_processors import adjust_logits
from nanopaged.sampling_params import SamplingParams
from nanopaged.sequence import Sequence


@cuda_compiled
def sample(logits: torch.Tensor, temperatures: torch.Tensor, uniform: torch.Tensor
           ) -> torch.Tensor:
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
    """The log-probability and 1-based rank of a token, and the most likely tokens'."""
    logprob: float
    rank: int
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass
class SamplerOutput:
    """What a step sampled, one entry per sampling row (the step's `samplers`, in order): the
    row's new token ids and, if its request asked for them, their logprobs. `prompt_logprobs`
    holds, by index into the step's sequences, the logprobs of the prompt tokens that a
    sequence asking for them ran in the step. With speculative decoding, `num_proposed` counts
    each row's proposals (a row gets the accepted ones and one token more)."""
    token_ids: list[list[int]]
    logprobs: list[list[TokenLogprobs] | None]
    prompt_logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)
    num_proposed: list[int] | None = None


class Sampler:
    """Samples one token per row of logits, each row with its own sequence's settings.

    Sampling inverts the cumulative distribution at one uniform number per row (a vocabulary's
    worth of random noise per row would cost more than the rest of a CPU step). A seeded
    sequence draws its number from its own generator, so its samples do not depend on what else
    shares the batch; the others draw from the engine's generator, seeded once (`seed`), so that
    a run repeats. Until a sequence has `min_tokens` tokens, the tokens that would stop it
    cannot be sampled.
    """

    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence],
                 proposals: list[list[int]] | None = None) -> SamplerOutput:
        """logits (R, V): one row per sequence of `seqs`; with `proposals` (speculative
        decoding), 1 + len(proposals[i]) consecutive rows for seqs[i], verified by
        `speculative.verify`."""
        rows = seqs if proposals is None else [
            seq for seq, tokens in zip(seqs, proposals) for _ in range(len(tokens) + 1)]
        raw_logits = logits
        logits, temperatures = self._target(logits, rows)
        if proposals is not None:
            from nanopaged.speculative import verify  # only when a step speculates
            token_ids = verify(logits, temperatures, proposals, self._uniform(rows, 2))
            first = np.cumsum([0] + [len(tokens) + 1 for tokens in proposals[:-1]])
        elif temperatures is None:
            token_ids, first = logits.argmax(dim=-1).view(-1, 1).tolist(), range(len(rows))
        else:
            tokens = sample(logits, temperatures, self._uniform(rows, 1)[:, 0])
            token_ids, first = tokens.view(-1, 1).tolist(), range(len(rows))
        return SamplerOutput(token_ids, self._logprobs(raw_logits, seqs, token_ids, first))

    def _target(self, logits: torch.Tensor, rows: list[Sequence]
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each row's logits as its settings make them, and the temperatures to sample them at
        (None when every row is greedy): penalties, grammars, min_tokens, then top-k, top-p and
        min-p over the tempered logits (which are then sampled at temperature 1)."""
        params = [seq.sampling_params for seq in rows]
        if any(p.adjusts_logits for p in params):
            logits = adjust_logits(logits, rows)
        if any(seq.grammar is not None for seq in rows):
            from nanopaged.structured_outputs import mask_logits  # only when a request asks
            logits = mask_logits(logits, rows)
        logits = self._mask_stop_tokens(logits, rows)
        if all(p.temperature == 0 for p in params):
            return logits, None
        temperatures = self._to_device([float(p.temperature) for p in params])
        if any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0 for p in params):
            logits = logits.float()
            shifted = logits - logits.amax(dim=-1, keepdim=True)
            tempered = shifted / torch.where(temperatures > 0, temperatures, 1.0).unsqueeze(1)
            return self._filter(tempered, params), (temperatures > 0).float()
        return logits, temperatures

    def _uniform(self, seqs: list[Sequence], per_row: int) -> torch.Tensor:
        """(rows, per_row) uniform numbers: a seeded row's from its own generator."""
        uniform = torch.rand(len(seqs), per_row, generator=self.generator)
        for i, seq in enumerate(seqs):
            if seq.generator is not None:
                uniform[i] = torch.rand(per_row, generator=seq.generator)
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

    def _logprobs(self, logits: torch.Tensor, seqs: list[Sequence], token_ids: list[list[int]],
                  first_rows) -> list[list[TokenLogprobs] | None]:
        """For the sequences that asked for them, the logprobs of the tokens they got, each in
        the distribution of the row it came from (rows first_rows[i], first_rows[i] + 1, ...)."""
        asking = [i for i, seq in enumerate(seqs) if seq.sampling_params.logprobs is not None]
        result: list[list[TokenLogprobs] | None] = [None] * len(seqs)
        if asking:
            rows = [first_rows[i] + j for i in asking for j in range(len(token_ids[i]))]
            ks = [seqs[i].sampling_params.logprobs for i in asking for _ in token_ids[i]]
            chosen = self._to_device([t for i in asking for t in token_ids[i]])
            entries = iter(self.logprobs(logits[self._to_device(rows)], chosen, ks))
            for i in asking:
                result[i] = [next(entries) for _ in token_ids[i]]
        return result

    def logprobs(self, logits: torch.Tensor, token_ids: torch.Tensor, ks: list[int]
                 ) -> list[TokenLogprobs]:
        """logits (R, V), token_ids (R,) -> for each row, the log-softmax of its token in the
        model's own distribution, its rank, and the ks[row] most likely tokens'."""
        logprobs = logits.float().log_softmax(dim=-1)                      # (R, V)
        chosen = logprobs.gather(1, token_ids.unsqueeze(1))                  # (R, 1)
        ranks = (logprobs > chosen).sum(dim=-1) + 1
        top = logprobs.topk(max(ks), dim=-1)
        columns = zip(chosen[:, 0].tolist(), ranks.tolist(), top.indices.tolist(),
                      top.values.tolist(), ks)
        return [TokenLogprobs(logprob, rank, top_ids[:k], top_logprobs[:k])
                for logprob, rank, top_ids, top_logprobs, k in columns]

    def _filter(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Top-k, top-p and min-p over each row's tempered logits (B, V)."""
        vocab_size = logits.shape[-1]
        top_k = self._to_device([min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size
                                 for p in params])
        top_p = self._to_device([float(p.top_p) for p in params])
        min_p = self._to_device([float(p.min_p) for p in params])
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        rank = torch.arange(vocab_size, device=self.device)
        drop = rank.unsqueeze(0) >= top_k.unsqueeze(1)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # drop a token when the tokens ranked above it already hold top_p of the mass
        drop |= (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p.unsqueeze(1)
        drop |= sorted_probs < min_p.unsqueeze(1) * sorted_probs[:, :1]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        return torch.empty_like(logits).scatter_(1, order, sorted_logits)

    def _to_device(self, values: list | torch.Tensor) -> torch.Tensor:
        # from pinned memory: a copy from pageable memory would first wait for the GPU to finish
        # the model's forward, and only then could the sampler's kernels be queued
        if self.device.type != "cuda":
            return torch.as_tensor(values)
        return torch.as_tensor(values).pin_memory().to(self.device, non_blocking=True)
