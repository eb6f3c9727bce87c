"""vLLM's `vllm.engine.arg_utils`: `EngineArgs`, every option of the engine."""

from nanopaged.compat import lacks
from nanopaged.engine_args import EngineArgs, FlexibleArgumentParser  # noqa: F401


def __getattr__(name: str):
    raise lacks(__name__, name, "nanopaged.engine.arg_utils has EngineArgs")
