"""Turns the logits of the sampling rows into next tokens: greedy, or sampled at a
temperature. vLLM's other settings (top-k, top-p, min-p, seeds, logits processors)
extend the `Sampler` above the core (`nanopaged/sampling/vllm_sampler.py`)."""

import torch

from nanopaged.core.layers import to_device
from nanopaged.core.sequence import SamplingOptions, Sequence

# A temperature below this samples greedily (vLLM's): 1 / T would overflow float32.
GREEDY_BELOW = 1e-5
# attention backend's name -> its own sampling kernel, a function as `sample` (the
# CPU's C kernel, the GPUs' Triton kernel: nanopaged/features.py enters them); a
# backend without one samples with `sample`
SAMPLING_KERNELS: dict = {}


# not compiled: torch 2.11's inductor failed on the split cumsum of Qwen3's vocabulary
def sample(logits: torch.Tensor, temperatures, uniform: torch.Tensor) -> torch.Tensor:
    """Per row, the first token whose cumulative probability under softmax(logits / T)
    exceeds `uniform` (in [0, 1)); T > 0. A row that is no distribution (every logit
    -inf, or a +inf or NaN among them) takes its greedy token, `first_argmax`: every
    backend's sampler gives that same in-range id."""
    logits = logits.float()
    peak = logits.amax(dim=-1, keepdim=True)
    shifted = logits - peak  # <= 0: no overflow
    weights = torch.exp(shifted / temperatures.unsqueeze(1))  # cdf[-1] is their sum
    cdf = weights.cumsum(dim=-1)
    sampled = torch.searchsorted(cdf, uniform.unsqueeze(1) * cdf[:, -1:], right=True)
    sampled = sampled.squeeze(1).clamp(max=logits.shape[-1] - 1)
    return torch.where(peak[:, 0].isfinite(), sampled, first_argmax(logits))


def first_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Per row, the first token of the largest logit, a NaN counting as +inf (token 0
    when every logit is -inf)."""
    inf = float("inf")
    return logits.nan_to_num(nan=inf, posinf=inf, neginf=-inf).argmax(dim=-1)


class Sampler:
    """Samples one token per row of logits, each row at its sequence's temperature (0:
    greedy), by inverting the cumulative distribution at one uniform number per row
    (cheaper than a vocabulary of noise) with `sample_fn` (a backend's own, else
    `sample`), the numbers from the engine's generator, seeded once (`seed`): a run
    repeats. Seam: a subclass may change the rows' logits (`adjust`) and numbers
    (`uniform`); the runner samples `profile_rows` (the most memory) once."""

    def __init__(self, device: torch.device, seed: int = 0, sample_fn=None):
        self.device = device
        self.sample = sample_fn or sample
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence], uniform=None):
        """logits (R, V): one row per sequence of `seqs` -> the token (R,) sampled from
        each, with the rows' numbers as `draw` gave them (None: drawn now, each row for
        its sequence's next token)."""
        logits = self.adjust(logits, seqs)
        temperatures = [seq.sampling_params.temperature for seq in seqs]
        greedy = [t < GREEDY_BELOW for t in temperatures]
        if all(greedy):
            return logits.argmax(dim=-1)
        temperatures = [max(t, GREEDY_BELOW) for t in temperatures]
        temperatures = to_device(self.device, temperatures, torch.float32)
        if uniform is None:
            uniform = self.uniform(seqs, [0] * len(seqs))
        sampled = self.sample(logits, temperatures, to_device(self.device, uniform))
        if any(greedy):
            greedy = to_device(self.device, greedy)
            sampled = torch.where(greedy, logits.argmax(dim=-1), sampled)
        return sampled

    def draw(self, seqs: list[Sequence], offsets: list[int]) -> torch.Tensor | None:
        """The rows' numbers, drawn when their step is launched, in step order (None
        when every row is greedy): the row `r` samples the token at position
        len(seqs[r]) + offsets[r], which a sequence may have several rows for."""
        if all(seq.sampling_params.temperature < GREEDY_BELOW for seq in seqs):
            return None
        return self.uniform(seqs, offsets)

    def adjust(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """The rows' logits as they are to be sampled: as the model gave them here."""
        return logits

    def uniform(self, seqs: list[Sequence], offsets: list[int]) -> torch.Tensor:
        """A number in [0, 1) per row, where its token is found in its distribution."""
        return torch.rand(len(seqs), generator=self.generator)

    def profile_rows(self, num_rows: int) -> list[Sequence]:
        return [Sequence([0], SamplingOptions(temperature=1.0))] * num_rows
