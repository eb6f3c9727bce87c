"""vLLM's `vllm.entrypoints`, where nanopaged's vLLM-facing front door lives as vLLM's
does: `llm` (`LLM`, over the core engine), `compat` (the methods of vLLM's `LLM` beyond
`generate`, `add_request` and `step`), `chat_utils` (conversations rendered by a chat
template), and `openai.api_server` (vLLM's path to the server, `nanopaged/serving/`).
Each is imported when first named."""

from nanopaged.engine.arg_utils import lazy_modules

__getattr__ = lazy_modules(
    __name__,
    ("llm", "compat", "chat_utils", "openai"),
    "nanopaged.entrypoints has llm (LLM) and openai.api_server",
)
