"""vLLM's helpers that its example scripts import from `vllm.utils`."""

import socket

from nanopaged.engine.arg_utils import FlexibleArgumentParser

__all__ = ["FlexibleArgumentParser", "get_open_port"]


def get_open_port() -> int:
    """A TCP port free on this machine now (vLLM's: for a process group's store)."""
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]
