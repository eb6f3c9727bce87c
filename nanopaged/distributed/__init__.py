"""vLLM's `vllm.distributed`: `cleanup_dist_env_and_memory`, and `parallel_state`."""

import gc

import torch
import torch.distributed as dist

from nanopaged.engine.arg_utils import lacks


def cleanup_dist_env_and_memory(shutdown_ray: bool = False) -> None:
    """vLLM's: leave the process group (if this process joined one) and give back the
    memory that freed engines left to the collectors and the GPU's cache."""
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def __getattr__(name: str):
    raise lacks(
        __name__,
        name,
        "nanopaged.distributed has cleanup_dist_env_and_memory and, in "
        "parallel_state, get_world_group; nanopaged's tensor parallelism "
        "is LLM(model, tensor_parallel_size=N)",
    )
