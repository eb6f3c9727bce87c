"""Model families beyond the core's Qwen3, Qwen2 and Llama. Importing this package
enters them in `core.model.ARCHITECTURES`: Mistral (the core's decoder, its
`sliding_window` on every layer), Qwen3-MoE and Mixtral (`moe.py`), Gemma 3 text
(`gemma3.py`); and the RoPE scalings of Llama 3 and others (`rope.py`) in
`core.layers.ROPE_SCALINGS`."""

from nanopaged.core.model import ARCHITECTURES, CausalLM
from nanopaged.models import gemma3, moe, rope  # noqa: F401 (they register themselves)

ARCHITECTURES["MistralForCausalLM"] = CausalLM
