"""The core: what every request passes through, read in the order a request travels:
llm_engine, scheduler (block_manager), step, model_runner (cuda_graphs), model (layers,
attention), sampler; sequence, config and loader hold what a sequence is, the options,
the weights. It imports nothing else of nanopaged, which plugs into the seams the core
documents where they are (their table: docs/architecture.md)."""
