"""How one sequence is sampled and how long it may grow. vLLM's `SamplingParams`
(`nanopaged/sampling_params.py`) extends these with its own fields and checks them all."""
from dataclasses import dataclass


@dataclass
class SamplingParams:
    """`temperature=0` is greedy decoding. `top_k` (0 or -1: off), `top_p` (1: off) and `min_p`
    (0: off) keep only the most likely tokens of the tempered distribution. A completion ends
    after `max_tokens` tokens (None: at the model's `max_model_len`), or at a stop token."""
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    max_tokens: int | None = 16
