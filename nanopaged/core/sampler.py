"""Turns the logits of the sampling rows into next tokens: greedy, or sampled at a temperature
from the top-k, top-p and min-p tokens."""
from collections.abc import Callable

import torch
import xxhash

from nanopaged.core.layers import to_device
from nanopaged.core.sequence import Sequence


# not `fused`: torch 2.11's inductor failed on the split cumsum of a 151,936-token vocabulary
def sample(logits: torch.Tensor, temperatures: torch.Tensor, uniform: torch.Tensor
           ) -> torch.Tensor:
    """Per row, the first token whose cumulative probability under softmax(logits / T) exceeds
    `uniform` (in [0, 1)); T > 0."""
    shifted = logits.float() - logits.float().amax(dim=-1, keepdim=True)  # <= 0: no overflow
    weights = torch.exp(shifted / temperatures.unsqueeze(1))  # unnormalised: cdf[-1] is the sum
    cdf = weights.cumsum(dim=-1)
    sampled = torch.searchsorted(cdf, uniform.unsqueeze(1) * cdf[:, -1:], right=True).squeeze(1)
    return sampled.clamp(max=logits.shape[-1] - 1)


def seeded_uniform(seed: int, position: int) -> float:
    """The uniform number in [0, 1) that samples the token at `position` of a seeded sequence."""
    digest = xxhash.xxh64_intdigest(position.to_bytes(8, "little"), seed=seed % 2 ** 64)
    return (digest >> 11) * 2.0 ** -53


class Sampler:
    """Samples one token per row of logits, each row with its own sequence's settings. Seam: each
    kind (class) of logits processor a row's sequence carries is called once a step,
    `kind.apply(logits, processors, seqs)`, with the float32 logits (R, V) of the rows that carry
    one, their processors and sequences, and returns their new logits (penalties, biases, grammar
    masks: kinds that commute). Sampling then inverts the cumulative distribution at one uniform
    number per row (cheaper than a vocabulary of noise). A seeded sequence's number for position p
    depends on its seed and p alone, so its samples do not depend on what shares its batch nor on
    how many tokens a step gives it; the other rows draw from the engine's generator, seeded once
    (`seed`), so that a run repeats."""

    def __init__(self, device: torch.device, seed: int = 0, sample_fn: Callable | None = None):
        self.device = device
        self.sample = sample_fn or sample  # or a backend's own (see `attention.Backend`)
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence],
                 offsets: list[int] | None = None) -> torch.Tensor:
        """logits (R, V): one row per sequence of `seqs` -> the token (R,) sampled from each.
        A sequence may have several rows: the row `r` samples the token at position
        len(seqs[r]) + offsets[r] (offsets: all 0 when None)."""
        logits = self.apply_processors(logits, seqs)
        params = [seq.sampling_params for seq in seqs]
        greedy = [p.temperature == 0 for p in params]
        if all(greedy):
            return logits.argmax(dim=-1)
        temperatures = to_device(self.device, [float(p.temperature) or 1.0 for p in params])
        if any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0 for p in params):
            shifted = logits.float() - logits.float().amax(dim=-1, keepdim=True)
            logits = self._filter(shifted / temperatures.unsqueeze(1), params)
            temperatures = torch.ones_like(temperatures)  # the logits are tempered already
        uniform = torch.rand(len(seqs), generator=self.generator)
        for r, seq in enumerate(seqs):
            if seq.seed is not None:
                uniform[r] = seeded_uniform(seq.seed, len(seq) + (offsets[r] if offsets else 0))
        sampled = self.sample(logits, temperatures, to_device(self.device, uniform))
        if any(greedy):
            sampled = torch.where(to_device(self.device, greedy), logits.argmax(dim=-1), sampled)
        return sampled

    def apply_processors(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        kinds: dict[type, tuple[list[int], list]] = {}
        for r, seq in enumerate(seqs):
            for processor in seq.logits_processors:
                rows, processors = kinds.setdefault(type(processor), ([], []))
                rows.append(r)
                processors.append(processor)
        if not kinds:
            return logits
        logits = logits.float().clone()
        for kind, (rows, processors) in kinds.items():
            index = to_device(self.device, rows)
            logits[index] = kind.apply(logits[index], processors, [seqs[r] for r in rows])
        return logits

    def _filter(self, logits: torch.Tensor, params: list) -> torch.Tensor:
        """Top-k, top-p and min-p over each row's tempered logits (B, V)."""
        vocab_size = logits.shape[-1]
        top_k, top_p, min_p = to_device(self.device, [
            [min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params],
            [float(p.top_p) for p in params], [float(p.min_p) for p in params]])
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        drop = torch.arange(vocab_size, device=self.device).unsqueeze(0) >= top_k.unsqueeze(1)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # drop a token when the tokens ranked above it already hold top_p of the mass
        drop |= (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p.unsqueeze(1)
        drop |= sorted_probs < min_p.unsqueeze(1) * sorted_probs[:, :1]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        return torch.empty_like(logits).scatter_(1, order, sorted_logits)
