"""vLLM's `vllm.entrypoints`, where nanopaged's vLLM-facing front door lives as vLLM's
does: `llm` (`LLM`, over the core engine), `compat` (the methods of vLLM's `LLM` beyond
`generate`, `add_request` and `step`), `chat_utils` (conversations rendered by a chat
template), and `openai.api_server` (vLLM's path to the server, `nanopaged/serving/`).
Each is imported when first named."""

import importlib

SUBMODULES = ("llm", "compat", "chat_utils", "openai")


def __getattr__(name: str):
    if name in SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name.startswith(
        "__"
    ):  # the import system's probes, while arg_utils may be loading
        raise AttributeError(name)
    from nanopaged.engine.arg_utils import lacks

    raise lacks(
        __name__, name, "nanopaged.entrypoints has llm (LLM) and openai.api_server"
    )
