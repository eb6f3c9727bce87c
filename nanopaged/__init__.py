"""nanopaged: a small LLM inference engine with paged attention.

The engine every request passes through is `nanopaged/core/`; vLLM's API stands above
it. Names are imported on first use, so that a command's `--help` loads neither torch
nor a model. The core's engine is `LLMEngineCore` (`nanopaged.core.llm_engine`, vLLM's
`EngineCore`); `nanopaged.LLMEngine` is vLLM's public name, kept for scripts written for
vLLM, of its engine driven a step at a time (`add_request`, `step`): nanopaged's `LLM`
has both APIs, so it is `LLM`. vLLM's other module paths are
modules of this package (`nanopaged.engine.arg_utils`, `nanopaged.distributed`,
`nanopaged.envs`, ...).
"""

import importlib

# public name -> the module that defines it
NAMES = {
    "LLM": "engine.llm",
    "LLMEngine": "engine.llm_engine",
    "EngineArgs": "engine.arg_utils",
    "SamplingParams": "sampling_params",
    "TextPrompt": "inputs",
    "TokensPrompt": "inputs",
    "CompletionOutput": "outputs",
    "Logprob": "outputs",
    "RequestOutput": "outputs",
    "LoRARequest": "lora.request",
    "PoolingParams": "pooling.params",
    "PoolingRequestOutput": "pooling.params",
    "EmbeddingRequestOutput": "pooling.params",
    "ClassificationRequestOutput": "pooling.params",
    "ScoringRequestOutput": "pooling.params",
}
__all__ = list(NAMES)


def __getattr__(name: str):
    if name not in NAMES:
        raise AttributeError(f"module 'nanopaged' has no attribute {name!r}")
    return getattr(importlib.import_module(f"nanopaged.{NAMES[name]}"), name)
