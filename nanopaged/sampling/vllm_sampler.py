"""vLLM's sampling settings beyond temperature, through the core `Sampler`'s seam: each
sequence's logits processors (penalties, biases, grammars), then top-k, top-p and min-p
over the tempered distribution, and seeds that make a sequence's samples its own."""

import torch
import xxhash

from nanopaged.core.layers import to_device
from nanopaged.core.sampler import GREEDY_BELOW, Sampler
from nanopaged.core.sequence import Sequence
from nanopaged.sampling_params import SamplingParams


def seeded_uniform(seed: int, position: int) -> float:
    """The number in [0, 1) that samples a seeded sequence's token at `position`."""
    digest = xxhash.xxh64_intdigest(position.to_bytes(8, "little"), seed=seed % 2**64)
    return (digest >> 11) * 2.0**-53


class VLLMSampler(Sampler):
    """The core's sampler with vLLM's settings. Each kind (class) of logits processor a
    row's sequence carries (`Sequence.logits_processors`) is called once a step,
    `kind.apply(logits, processors, seqs)`, with the float32 logits (R, V) of the rows
    that carry one, their processors and sequences, and returns their new logits
    (penalties, biases, grammar masks: kinds that commute). Then the tokens that top-k,
    top-p and min-p drop from each row's tempered distribution get probability 0. A
    seeded sequence's number for position p depends on its seed and p alone, so its
    samples do not depend on what shares its batch nor on how many tokens a step gives
    it; the other rows draw from the engine's generator."""

    def adjust(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        logits = self.apply_processors(logits, seqs)
        params = [seq.sampling_params for seq in seqs]
        if any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0 for p in params):
            logits = self.filter(logits, params)
        return logits

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
        """The logits (B, V), -inf where top-k, top-p or min-p drop a token from its
        row's tempered distribution."""
        vocab_size = logits.shape[-1]
        top_k = [
            min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params
        ]
        top_p, min_p = [p.top_p for p in params], [p.min_p for p in params]
        temperatures = [max(p.temperature, GREEDY_BELOW) for p in params]
        settings = to_device(self.device, [top_k, top_p, min_p, temperatures])
        top_k, top_p, min_p, temperatures = settings.float().unsqueeze(2)
        logits = logits.float()
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        drop = torch.arange(vocab_size, device=self.device) >= top_k
        sorted_probs = (sorted_logits / temperatures).softmax(dim=-1)
        # drop a token when the tokens ranked above it already hold top_p of the mass
        drop |= (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p
        drop |= sorted_probs < min_p * sorted_probs[:, :1]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        return torch.empty_like(logits).scatter_(1, order, sorted_logits)

    def processed(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """The rows' logits as their tokens were drawn from them (vLLM's
        "processed_logprobs"): top-k, top-p and min-p applied, then divided by the
        temperature (a greedy row's as they are). Processors that read the tokens so
        far (penalties) are not applied: those tokens have moved on since."""
        params = [seq.sampling_params for seq in seqs]
        logits = logits.float()
        if any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0 for p in params):
            logits = self.filter(logits, params)
        temperatures = [
            p.temperature if p.temperature >= GREEDY_BELOW else 1.0 for p in params
        ]
        return logits / to_device(self.device, temperatures, torch.float32)[:, None]

    def uniform(self, seqs: list[Sequence], offsets: list[int]) -> torch.Tensor:
        uniform = super().uniform(seqs, offsets)
        for r, seq in enumerate(seqs):
            if seq.seed is not None:
                uniform[r] = seeded_uniform(seq.seed, len(seq) + offsets[r])
        return uniform

    def profile_rows(self, num_rows: int) -> list[Sequence]:
        """Rows that sample through the filter, its sort its largest buffer."""
        return [Sequence([0], SamplingParams(temperature=1.0, top_p=0.9))] * num_rows
