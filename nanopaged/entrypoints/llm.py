"""vLLM's `vllm.entrypoints.llm`: `LLM`."""

from nanopaged.llm import LLM  # noqa: F401
