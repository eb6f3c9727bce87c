"""nanopaged: a small LLM inference engine with paged attention.

The engine every request passes through is `nanopaged/core/`; vLLM's API stands above
it. Names are imported on first use, so that a command's `--help` loads neither torch
nor a model. Inside nanopaged, `LLMEngine` names the core's engine
(`nanopaged.core.llm_engine`); `nanopaged.LLMEngine` is only vLLM's public name, kept
for scripts written for vLLM, of its engine driven a step at a time (`add_request`,
`step`): nanopaged's `LLM` has both APIs, so it is `LLM`. vLLM's other module paths are
modules of this package (`nanopaged.engine.arg_utils`, `nanopaged.distributed`,
`nanopaged.envs`, ...).
"""

import importlib
import os

# OpenMP threads wait for their next parallel region asleep, not spinning: on a machine
# shared with other OpenMP processes (a second engine, a test suite), threads spinning
# for a descheduled peer made the CPU backend 25x slower (docs/cpu.md). The OpenMP
# runtime reads it once, when torch loads it: so only if nanopaged is imported first. A
# value already set stays (an empty one: the runtime's default, which spins a while).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# public name -> the module that defines it
NAMES = {
    "LLM": "llm",
    "LLMEngine": "engine.llm_engine",
    "EngineArgs": "engine_args",
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
