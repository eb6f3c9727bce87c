"""How a request's tokens are chosen, above the core's `Sampler` (`core/sampler.py`),
each file a feature a forker may delete:

- `vllm_sampler.py`: vLLM's sampling settings (top-k, top-p, min-p, per-request seeds)
  through the `Sampler`'s seam (`VLLMSampler`);
- `logits_processors.py`: penalties, logit biases, allowed and bad words, `min_tokens`,
  as each sequence's logits processors;
- `structured_outputs.py`: JSON schemas, regular expressions, choices and grammars, a
  mask over each row (imported only when a request asks for one);
- `triton_kernel.py`: the GPU backends' sampling kernel (`features.py` enters it).

vLLM's `SamplingParams` is `nanopaged/sampling_params.py`, at vLLM's module path."""
