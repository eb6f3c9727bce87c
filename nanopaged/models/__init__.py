"""Model families beyond the core's Qwen3, Qwen2 and Llama, which `features.py` enters
in `core.model.ARCHITECTURES`: Mistral (the core's decoder, its `sliding_window` on
every layer), Qwen3-MoE and Mixtral (`moe.py`), Gemma 3 text (`gemma3.py`), the pooling
models' bodies and classifiers (`pooling.py`, which `pooling/` serves); and the RoPE
scalings of Llama 3 and others (`rope.py`) in `core.layers.ROPE_SCALINGS`."""
