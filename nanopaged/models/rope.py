"""RoPE scalings beyond the plain one, entered in the core's `layers.ROPE_SCALINGS`
under the `rope_type` a checkpoint's config names: each makes the inverse frequencies of
the plain rotary embedding into the scaled ones."""

import math

import torch


def llama3(inv_freq: torch.Tensor, parameters: dict) -> torch.Tensor:
    """Llama 3's frequency scaling: long wavelengths slowed by `factor`, short ones
    kept, the band between blended smoothly."""
    factor = parameters["factor"]
    low, high = parameters["low_freq_factor"], parameters["high_freq_factor"]
    old_len = parameters["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, blended, scaled)


def linear(inv_freq: torch.Tensor, parameters: dict) -> torch.Tensor:
    """Positions divided by `factor`."""
    return inv_freq / parameters["factor"]
