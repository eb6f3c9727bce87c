"""vLLM's `vllm.profiler`, whose layerwise profiler nanopaged has not: it profiles with
`LLM.start_profile()` / `stop_profile()` (torch.profiler), as vLLM's LLM does."""

from nanopaged.engine.arg_utils import lacks


def __getattr__(name: str):
    raise lacks(
        __name__,
        name,
        "nanopaged profiles with LLM.start_profile() / stop_profile() "
        "(torch.profiler, as vLLM's LLM does)",
    )
