"""The core: what every request passes through. Read it in the order a request travels:
llm_engine, scheduler (block_manager), step, model_runner (cuda_graphs), model (layers,
attention), sampler; sequence, config and loader hold what a sequence is, the options
and the weights. Nothing here imports the rest of nanopaged, which stands above and
plugs into the seams the core documents: `LLMEngine` (the two ends of a step),
`Sequence` (stop tokens, logits processors, seeds, prompt logits, cache salts),
`Sampler` (logits processors), `ModelRunner` (a subclass per tensor-parallel rank; a
`RunnerExtension`: LoRA's), `attention.BACKENDS` (a backend's `Kernels`),
`layers.LinearMethod`, `layers.ROPE_SCALINGS`, `loader.QUANTIZATIONS` and
`model.ARCHITECTURES`."""
