"""nanopaged: a small LLM inference engine with paged attention.

The engine every request passes through is `nanopaged/core/`; vLLM's API stands above it.
Names are imported on first use, so that a command's `--help` loads neither torch nor a model.
"""
import importlib
import importlib.abc
import importlib.util
import sys

# public name -> the module that defines it
NAMES = {"LLM": "llm", "LLMEngine": "llm", "EngineArgs": "engine_args",
         "SamplingParams": "sampling_params", "TextPrompt": "inputs", "TokensPrompt": "inputs",
         "CompletionOutput": "outputs", "Logprob": "outputs", "RequestOutput": "outputs"}
__all__ = list(NAMES)


def __getattr__(name: str):
    if name not in NAMES:
        raise AttributeError(f"module 'nanopaged' has no attribute {name!r}")
    module = importlib.import_module(f"nanopaged.{NAMES[name]}")
    return module.LLM if name == "LLMEngine" else getattr(module, name)  # the same engine


class _VLLMPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds vLLM's other module paths (`nanopaged.engine.arg_utils`, `nanopaged.distributed`,
    ...), which `vllm_paths.py` makes."""

    def find_spec(self, name: str, path=None, target=None):
        from_vllm = ("engine", "entrypoints", "distributed", "envs", "profiler")
        if name.partition(".")[0] == "nanopaged" and name.split(".")[1] in from_vllm:
            return importlib.util.spec_from_loader(name, self)
        return None

    def create_module(self, spec):
        from nanopaged import vllm_paths
        return vllm_paths.module(spec.name)

    def exec_module(self, module) -> None:
        pass


sys.meta_path.insert(0, _VLLMPaths())
