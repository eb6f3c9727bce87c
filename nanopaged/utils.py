"""vLLM's helpers that its example scripts import from `vllm.utils`."""
from nanopaged.compat import FlexibleArgumentParser

__all__ = ["FlexibleArgumentParser"]
