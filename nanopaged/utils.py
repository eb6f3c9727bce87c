"""vLLM's helpers that its example scripts import from `vllm.utils`."""

from nanopaged.engine.arg_utils import FlexibleArgumentParser

__all__ = ["FlexibleArgumentParser"]
