"""vLLM's `vllm.engine`: `arg_utils` (`EngineArgs`, and how nanopaged checks every
option and makes the core's `Config` of them) and `llm_engine` (vLLM's `LLMEngine`,
which is nanopaged's `LLM`), each imported when first named."""

from nanopaged.engine.arg_utils import lazy_modules

__getattr__ = lazy_modules(
    __name__,
    ("arg_utils", "llm_engine"),
    "nanopaged's engines are all synchronous (the server runs one in a thread)",
)
