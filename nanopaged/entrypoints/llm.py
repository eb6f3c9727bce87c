"""vLLM's `vllm.entrypoints.llm`: `LLM`, which nanopaged defines in `engine/llm.py`."""

from nanopaged.engine.arg_utils import lacks
from nanopaged.engine.llm import LLM

__all__ = ["LLM"]


def __getattr__(name: str):
    raise lacks(__name__, name, "nanopaged.entrypoints.llm has LLM")
