"""Turns the logits of the sampling rows into next tokens: greedy, temperature, top-k, top-p."""
import torch

from nanopaged.layers import cuda_compiled
from nanopaged.sequence import Sequence


@cuda_compiled
def sample(logits: torch.Tensor, temperatures: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """argmax(softmax(logits / T) / noise) per row, or argmax(logits) where T is 0."""
    logits = logits.float()
    probs = torch.softmax(logits / torch.where(temperatures > 0, temperatures, 1.0).unsqueeze(1), dim=-1)
    return torch.where(temperatures > 0, (probs / noise).argmax(dim=-1), logits.argmax(dim=-1))


class Sampler:
    """Samples one token per row of logits, each row with its own request's settings.

    Sampling uses the exponential race: argmax(p / E) with E ~ Exp(1) draws from p. A seeded
    request draws its noise from its own generator, so its samples do not depend on what else
    shares the batch.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.generators: dict[int, torch.Generator] = {}

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        # logits: (B, V), one row per sequence in `seqs`
        params = [seq.sampling_params for seq in seqs]
        if all(p.temperature == 0 for p in params):
            return logits.argmax(dim=-1)
        temperatures = self._to_device([p.temperature for p in params])
        if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
            # filter the tempered distribution; the rows are then sampled at temperature 1
            tempered = logits.float() / torch.where(temperatures > 0, temperatures, 1.0).unsqueeze(1)
            logits = self._top_k_top_p(tempered, params)
            temperatures = (temperatures > 0).float()
        noise = torch.empty(logits.shape, device=self.device).exponential_()
        for i, seq in enumerate(seqs):
            if seq.sampling_params.seed is not None:
                noise[i].exponential_(generator=self._generator(seq))
        return sample(logits, temperatures, noise)

    def _top_k_top_p(self, logits: torch.Tensor, params) -> torch.Tensor:
        vocab_size = logits.shape[-1]
        top_k = self._to_device([p.top_k if p.top_k > 0 else vocab_size for p in params])
        top_p = self._to_device([p.top_p for p in params])
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        rank = torch.arange(vocab_size, device=self.device)
        drop = rank.unsqueeze(0) >= top_k.unsqueeze(1)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # drop a token when the tokens ranked above it already hold top_p of the mass
        drop |= (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p.unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        return torch.empty_like(logits).scatter_(1, order, sorted_logits)

    def _to_device(self, values: list[float]) -> torch.Tensor:
        # from pinned memory: a copy from pageable memory would first wait for the GPU to finish
        # the model's forward, and only then could the sampler's kernels be queued
        pinned = self.device.type == "cuda"
        return torch.tensor(values, pin_memory=pinned).to(self.device, non_blocking=pinned)

    def _generator(self, seq: Sequence) -> torch.Generator:
        generator = self.generators.get(seq.seq_id)
        if generator is None:
            generator = torch.Generator(self.device).manual_seed(seq.sampling_params.seed)
            self.generators[seq.seq_id] = generator
        return generator

    def release(self, seq: Sequence) -> None:
        """Forgets a finished sequence's generator."""
        self.generators.pop(seq.seq_id, None)
