"""vLLM's helpers that its example scripts import from `vllm.utils`."""

from nanopaged.engine_args import FlexibleArgumentParser

__all__ = ["FlexibleArgumentParser"]
