"""vLLM's `vllm.entrypoints`: `llm` (LLM) and `openai.api_server` (the server)."""

from nanopaged.compat import lacks


def __getattr__(name: str):
    raise lacks(
        __name__, name, "nanopaged.entrypoints has llm (LLM) and openai.api_server"
    )
