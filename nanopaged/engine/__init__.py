"""vLLM's `vllm.engine`: `arg_utils` (EngineArgs) and `llm_engine` (LLMEngine)."""

from nanopaged.compat import lacks
from nanopaged.engine import arg_utils, llm_engine  # noqa: F401


def __getattr__(name: str):
    raise lacks(
        __name__,
        name,
        "nanopaged's engines are all synchronous (the server runs one in a thread)",
    )
