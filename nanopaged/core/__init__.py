"""The core: what every request passes through, in the order a request travels.

    llm_engine     sequences in; schedule a step, run it, apply what it sampled
    scheduler      which sequences a step runs, and how many tokens each (a `ScheduledStep`)
    block_manager  the KV-cache blocks, their ref counts, and the hash-chained prefix cache
    model_runner   a step's inputs, the KV cache, CUDA graphs (cuda_graphs), sampling
    model          the decoder (layers), through paged attention (attention, triton_attention)
    sampler        the next token of each sampling row
    sequence, sampling_params, config, loader: what a sequence is, the options, the weights

Nothing here imports the rest of nanopaged. The rest (vLLM's API, outputs, the server,
speculative decoding, parallelism, structured outputs, more model families) stands above and
plugs into these seams:
- `Sequence.stop_token_ids`, `.seed` and `.prompt_logits`: when a completion stops, seeded
  sampling, the logits of the prompt (for its logprobs);
- `Sequence.logits_processors`: per-row changes of the logits, applied by the `Sampler`;
- a proposer handed to the `ModelRunner` (tokens to verify in lookahead slots, which the
  `Scheduler` reserves), and a `ModelRunner` subclass that runs on several processes;
- `model.ARCHITECTURES`: more model classes;
- `LLMEngine`'s methods: `add`, `step`, `finish`, `is_finished`, and the `SamplerOutput` of a
  step (its tokens and logits).
"""
