"""vLLM's `vllm.engine.llm_engine`: `LLMEngine`, the engine driven a step at a time
(`add_request`, `step`), which in nanopaged is the `LLM` class itself."""

from nanopaged.engine.arg_utils import lacks
from nanopaged.engine.llm import LLM

LLMEngine = LLM


def __getattr__(name: str):
    raise lacks(__name__, name, "nanopaged.engine.llm_engine has LLMEngine")
