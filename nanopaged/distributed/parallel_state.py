"""vLLM's `vllm.distributed.parallel_state`: `get_world_group()`, this process's place
among the ranks (under torchrun, say)."""

import os

import torch.distributed as dist

from nanopaged.distributed import cleanup_dist_env_and_memory
from nanopaged.engine.arg_utils import lacks


class WorldGroup:
    """vLLM's `get_world_group()`: this process's place among all ranks, and its
    groups."""

    def __init__(self):
        if not dist.is_initialized():
            raise RuntimeError(
                "get_world_group(): this process is in no distributed group; "
                "under torchrun, create the LLM first"
            )
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.ranks = list(range(self.world_size))
        self.rank_in_group = self.rank
        self.local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
        self.device_group = dist.group.WORLD
        # for control messages, as vLLM's
        self.cpu_group = dist.new_group(backend="gloo")


get_world_group = WorldGroup
destroy_distributed_environment = cleanup_dist_env_and_memory


def destroy_model_parallel() -> None:
    """vLLM's; nanopaged has no model-parallel groups beyond the world's."""


def __getattr__(name: str):
    raise lacks(
        __name__, name, "nanopaged.distributed.parallel_state has get_world_group"
    )
