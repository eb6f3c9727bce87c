"""Pooling models: embeddings, class probabilities and scores from the same engine, as
vLLM's pooling runner gives them. A pooling request is a prefill that never decodes.
`features.py` enters the pooling architectures (`models/pooling.py`, beside the other
model families) in the core's `ARCHITECTURES`; `LLM(model, runner="pooling")` is a
`PoolingLLM` (`pooling_llm.py`), which pools as the checkpoint declares (`pooler.py`)
with vLLM's `PoolingParams` (`params.py`)."""
