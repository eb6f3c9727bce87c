"""Turns the logits of the sampling rows into next tokens: greedy, or sampled at a
temperature from the top-k, top-p and min-p tokens."""

import torch
import xxhash

from nanopaged.core.layers import to_device
from nanopaged.core.sequence import Sequence

# A temperature below this samples greedily (vLLM's): 1 / T would overflow float32.
GREEDY_BELOW = 1e-5


# not compiled: torch 2.11's inductor failed on the split cumsum of Qwen3's vocabulary
def sample(logits: torch.Tensor, temperatures, uniform: torch.Tensor) -> torch.Tensor:
    """Per row, the first token whose cumulative probability under softmax(logits / T)
    exceeds `uniform` (in [0, 1)); T > 0."""
    logits = logits.float()
    shifted = logits - logits.amax(dim=-1, keepdim=True)  # <= 0: no overflow
    weights = torch.exp(shifted / temperatures.unsqueeze(1))  # cdf[-1] is their sum
    cdf = weights.cumsum(dim=-1)
    sampled = torch.searchsorted(cdf, uniform.unsqueeze(1) * cdf[:, -1:], right=True)
    return sampled.squeeze(1).clamp(max=logits.shape[-1] - 1)


def seeded_uniform(seed: int, position: int) -> float:
    """The number in [0, 1) that samples a seeded sequence's token at `position`."""
    digest = xxhash.xxh64_intdigest(position.to_bytes(8, "little"), seed=seed % 2**64)
    return (digest >> 11) * 2.0**-53


class Sampler:
    """Samples one token per row of logits, each row with its own sequence's settings.
    Seam: each kind (class) of logits processor a row's sequence carries is called once
    a step, `kind.apply(logits, processors, seqs)`, with the float32 logits (R, V) of
    the rows that carry one, their processors and sequences, and returns their new
    logits (penalties, biases, grammar masks: kinds that commute). Sampling then inverts
    the cumulative distribution at one uniform number per row (cheaper than a vocabulary
    of noise), by `sample_fn` (a backend's own, else `sample`). A seeded sequence's
    number for position p depends on its seed and p alone, so its samples do not depend
    on what shares its batch nor on how many tokens a step gives it; the other rows draw
    from the engine's generator, seeded once (`seed`), so that a run repeats."""

    def __init__(self, device: torch.device, seed: int = 0, sample_fn=None):
        self.device = device
        self.sample = sample_fn or sample
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence], offsets=None):
        """logits (R, V): one row per sequence of `seqs` -> the token (R,) sampled from
        each. A sequence may have several rows: the row `r` samples the token at
        position len(seqs[r]) + offsets[r] (offsets: all 0 when None)."""
        logits = self.apply_processors(logits, seqs)
        params = [seq.sampling_params for seq in seqs]
        greedy = [p.temperature < GREEDY_BELOW for p in params]
        if all(greedy):
            return logits.argmax(dim=-1)
        temperatures = [max(p.temperature, GREEDY_BELOW) for p in params]
        temperatures = to_device(self.device, temperatures, torch.float32)
        if any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0 for p in params):
            logits = logits.float() - logits.float().amax(dim=-1, keepdim=True)
            logits = self.filter(logits / temperatures.unsqueeze(1), params)
            temperatures = torch.ones_like(temperatures)  # tempered already
        uniform = torch.rand(len(seqs), generator=self.generator)
        for r, seq in enumerate(seqs):
            if seq.seed is not None:
                position = len(seq) + (offsets[r] if offsets else 0)
                uniform[r] = seeded_uniform(seq.seed, position)
        sampled = self.sample(logits, temperatures, to_device(self.device, uniform))
        if any(greedy):
            greedy = to_device(self.device, greedy)
            sampled = torch.where(greedy, logits.argmax(dim=-1), sampled)
        return sampled

    def apply_processors(self, logits: torch.Tensor, seqs: list[Sequence]):
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
            row_seqs = [seqs[r] for r in rows]
            logits[index] = kind.apply(logits[index], processors, row_seqs)
        return logits

    def filter(self, logits: torch.Tensor, params: list) -> torch.Tensor:
        """Top-k, top-p and min-p over each row's tempered logits (B, V)."""
        vocab_size = logits.shape[-1]
        top_k = [
            min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params
        ]
        top_p, min_p = [p.top_p for p in params], [p.min_p for p in params]
        top_k, top_p, min_p = to_device(self.device, [top_k, top_p, min_p]).unsqueeze(2)
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        drop = torch.arange(vocab_size, device=self.device) >= top_k
        sorted_probs = sorted_logits.softmax(dim=-1)
        # drop a token when the tokens ranked above it already hold top_p of the mass
        drop |= (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p
        drop |= sorted_probs < min_p * sorted_probs[:, :1]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        return torch.empty_like(logits).scatter_(1, order, sorted_logits)
