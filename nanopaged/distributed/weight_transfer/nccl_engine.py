"""vLLM's `vllm.distributed.weight_transfer.nccl_engine`: the trainer's side of the
weight transfer, `NCCLWeightTransferEngine.trainer_init` and `.trainer_send_weights`, as
vLLM's RL examples call them. The group is NCCL between GPUs and gloo between CPUs
(`nanopaged/rl/transfer.py`).
"""

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from nanopaged.rl import transfer


@dataclass
class NCCLWeightTransferInitInfo:
    """What `init_weight_transfer_engine` takes, as a dataclass."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int


@dataclass
class NCCLWeightTransferUpdateInfo:
    """What `update_weights` takes, as a dataclass: the weights in the trainer's order.
    `packed` (vLLM's batched broadcast) is accepted; each weight goes alone here."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    packed: bool = False


@dataclass
class NCCLTrainerSendWeightsArgs:
    """`trainer_send_weights`'s arguments: the group `trainer_init` gave, the sending
    rank, and a function of each (name, tensor) that gives the tensor to send."""

    group: transfer.TransferGroup
    src: int = 0
    post_iter_func: Callable | None = None
    packed: bool = False
    stream: object = None


class NCCLWeightTransferEngine:
    """The trainer's side (vLLM's static methods)."""

    @staticmethod
    def trainer_init(init_info) -> transfer.TransferGroup:
        """Joins the weight-transfer group as rank 0 (a dict or
        `NCCLWeightTransferInitInfo`): returns once every rank of the engine has
        joined too (its `init_weight_transfer_engine` runs meanwhile)."""
        if not isinstance(init_info, dict):
            init_info = vars(init_info)
        return transfer.trainer_init(init_info)

    @staticmethod
    def trainer_send_weights(
        iterator: Iterable[tuple[str, torch.Tensor]], trainer_args
    ) -> None:
        """Broadcasts every weight of `iterator` (the engine's `update_weights`
        receives them meanwhile, told their names, dtypes and shapes)."""
        if isinstance(trainer_args, dict):
            trainer_args = NCCLTrainerSendWeightsArgs(**trainer_args)
        post = trainer_args.post_iter_func or (lambda item: item[1])
        transfer.trainer_send_weights(
            ((name, post((name, tensor))) for name, tensor in iterator),
            trainer_args.group,
            trainer_args.src,
        )
