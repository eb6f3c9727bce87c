"""vLLM's `vllm.engine`: `arg_utils` (`EngineArgs`, and how nanopaged checks every
option and makes the core's `Config` of them) and `llm_engine` (vLLM's `LLMEngine`,
which is nanopaged's `LLM`), each imported when first named."""

import importlib

SUBMODULES = ("arg_utils", "llm_engine")


def __getattr__(name: str):
    if name in SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name.startswith(
        "__"
    ):  # the import system's probes, while arg_utils may be loading
        raise AttributeError(name)
    from nanopaged.engine.arg_utils import lacks

    raise lacks(
        __name__,
        name,
        "nanopaged's engines are all synchronous (the server runs one in a thread)",
    )
