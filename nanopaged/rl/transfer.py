"""Weights sent by a trainer in another process (vLLM's weight transfer, its "nccl"
backend): the trainer and every rank of the engine meet in a process group of their
own, the trainer rank 0, and each new weight is broadcast from it.

The group is "stateless", as vLLM's: a TCP store that the trainer serves and a gloo
(CPU) or NCCL (GPU) group built on it, apart from torch.distributed's default group,
which the trainer (its own training) and the engine (tensor parallelism) keep for
themselves. Nothing of the process's torch.distributed state changes.

The engine's side (`TransferGroup.join`, `receive`) runs on every rank of the engine,
through `collective_rpc`; the trainer's (`trainer_init`, `trainer_send_weights`) is
what vLLM's `NCCLWeightTransferEngine` offers a trainer, at vLLM's path
(`nanopaged.distributed.weight_transfer.nccl_engine`).
"""

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

# how long a member waits for the others to join, or for a broadcast's sender
TIMEOUT = datetime.timedelta(minutes=10)


@dataclass
class TransferGroup:
    """One member's handle on the group: its rank and the process group. `broadcast`
    is vLLM's communicator's."""

    rank: int
    world_size: int
    group: dist.ProcessGroup
    store: dist.Store

    @classmethod
    def join(
        cls,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        nccl: bool,
    ) -> "TransferGroup":
        """Joins (rank 0 serves the store) over NCCL (the members' GPUs) or gloo;
        returns once every member has."""
        if not 0 <= rank < world_size:
            raise ValueError(
                f"rank {rank} is not in a weight-transfer group of {world_size} "
                f"(the trainer is rank 0; an engine's ranks start at rank_offset)"
            )
        store = dist.TCPStore(
            master_address,
            master_port,
            world_size,
            is_master=rank == 0,
            timeout=TIMEOUT,
            wait_for_workers=False,
        )
        if nccl:
            group = dist.ProcessGroupNCCL(store, rank, world_size)
        else:
            group = dist.ProcessGroupGloo(store, rank, world_size, TIMEOUT)
        # every member here: a first collective meets them all
        group.barrier().wait()
        return cls(rank, world_size, group, store)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, stream=None) -> None:
        """`tensor` from rank `src` to every member, in place."""
        self.group.broadcast(tensor, src).wait()


def check_update_info(update_info) -> list[tuple[str, torch.dtype, list[int]]]:
    """vLLM's update info (`names`, `dtype_names`, `shapes`, three lists of one length)
    -> (name, dtype, shape) per weight, in the order the trainer sends them; a
    ValueError names what is wrong."""
    if not isinstance(update_info, dict):
        raise ValueError(
            f"update_info must be a dict of names, dtype_names and shapes, got "
            f"{type(update_info).__name__}"
        )
    lists = [update_info.get(key) for key in ("names", "dtype_names", "shapes")]
    if not all(isinstance(value, (list, tuple)) for value in lists):
        raise ValueError("update_info needs the lists names, dtype_names and shapes")
    names, dtype_names, shapes = lists
    if not len(names) == len(dtype_names) == len(shapes):
        raise ValueError(
            f"update_info's names, dtype_names and shapes differ in length: "
            f"{len(names)}, {len(dtype_names)}, {len(shapes)}"
        )
    entries = []
    for name, dtype_name, shape in zip(names, dtype_names, shapes):
        dtype = getattr(torch, str(dtype_name), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{name!r}: {dtype_name!r} is no torch dtype")
        entries.append((name, dtype, list(shape)))
    return entries


def receive(
    group: TransferGroup, update_info: dict, device: torch.device
) -> list[tuple[str, torch.Tensor]]:
    """Every weight `update_info` announces, received in its order from the trainer."""
    weights = []
    for name, dtype, shape in check_update_info(update_info):
        tensor = torch.empty(shape, dtype=dtype, device=device)
        group.broadcast(tensor, src=0)
        weights.append((name, tensor))
    return weights


def trainer_init(init_info: dict) -> TransferGroup:
    """The trainer's side of `init_weight_transfer_engine`: joins the group as rank 0
    (`init_info`: master_address, master_port, world_size, and `backend`: "nccl", the
    default where this process has a GPU, or "gloo", the default elsewhere; the engine
    uses NCCL for "nccl" on a GPU, gloo otherwise)."""
    cuda = torch.cuda.is_available()
    backend = init_info.get("backend", "nccl" if cuda else "gloo")
    return TransferGroup.join(
        init_info["master_address"],
        int(init_info["master_port"]),
        0,
        int(init_info["world_size"]),
        nccl=backend == "nccl" and cuda,
    )


def trainer_send_weights(weights, group: TransferGroup, src: int = 0) -> None:
    """Broadcasts each (name, tensor) of `weights` to the engine, in order: the order
    and the names, dtypes and shapes the engine was told in its update info."""
    for _, tensor in weights:
        group.broadcast(tensor.detach().contiguous(), src=src)
