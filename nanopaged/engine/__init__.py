"""The engine as vLLM's users drive it, over the core's: `arg_utils` (vLLM's
`EngineArgs`, and how nanopaged checks every option and makes the core's `Config` of
them), `llm` (`LLM`: requests in, `RequestOutput`s out), the methods of vLLM's `LLM`
beyond `generate` (`compat`) and a trainer's (`training`), `data_parallel` (replicas of
`LLM`, one per process, behind its API) and `llm_engine` (vLLM's `LLMEngine`, which is
`LLM`). Each is imported when first named."""

from nanopaged.engine.arg_utils import lazy_modules

__getattr__ = lazy_modules(
    __name__,
    ("arg_utils", "llm", "compat", "training", "data_parallel", "llm_engine"),
    "nanopaged's engines are all synchronous (the server runs one in a thread)",
)
