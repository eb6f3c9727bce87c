"""vLLM's `vllm.entrypoints`, at the top of the package as every vLLM path is: `llm`
(`LLM`, defined in `engine/llm.py`) and `openai.api_server` (the server, defined in
`serving/`). Each is imported when first named."""

from nanopaged.engine.arg_utils import lazy_modules

__getattr__ = lazy_modules(
    __name__,
    ("llm", "openai"),
    "nanopaged.entrypoints has llm (LLM) and openai.api_server",
)
