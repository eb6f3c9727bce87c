"""Pooling models: embeddings, class probabilities and scores from the same engine, as
vLLM's pooling runner gives them. A pooling request is a prefill that never decodes.
Importing this package enters the pooling architectures in the core's `ARCHITECTURES`
(`models.py`); `LLM(model, runner="pooling")` is a `PoolingLLM` (`llm.py`), which pools
as the checkpoint declares (`pooler.py`) with vLLM's `PoolingParams` (`params.py`)."""

from nanopaged.pooling import models  # noqa: F401 (it registers the architectures)
