"""The core: what every request passes through. Read it in the order a request travels:
llm_engine, scheduler (block_manager), step, model_runner (cuda_graphs), model (layers,
attention), sampler; sequence, sampling_params, config and loader hold what a sequence is, the
options and the weights. Nothing here imports the rest of nanopaged, which stands above and
plugs into the seams that `Sequence`, `Sampler`, `ModelRunner`, `Scheduler` and
`model.ARCHITECTURES` document (see the README's "Where the features plug in")."""
