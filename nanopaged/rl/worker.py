"""One rank of the engine as vLLM's `collective_rpc` reaches it: a `Worker`, made on
each rank the first time a call comes (rank 0 in the engine's process, a tensor-parallel
worker in its own), holding that rank's part of RL: its weight writer, its end of a
weight-transfer group, its sleep.

`rank_call` is what the engine sends every rank (`MultiprocRunner.call`): a worker
method's name, or a function that takes the worker, as vLLM's `collective_rpc` takes
them.
"""

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from nanopaged.rl.sleep import Sleeper
from nanopaged.rl.transfer import TransferGroup, receive
from nanopaged.rl.weights import WeightWriter


class Worker:
    """A rank: `model_runner` and `model` are the worker itself, as vLLM's paths to a
    rank's model reach it (`worker.model_runner.model.load_weights(...)`), `runner` the
    rank's `ModelRunner` and `module` its model (an `nn.Module`), `rank` its
    tensor-parallel rank, `device` its device."""

    def __init__(self, runner):
        self.runner = runner
        self.module = runner.model
        self.device = runner.device
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        config = runner.config
        self.weights = WeightWriter(runner.model, config.hf_config, config.model)
        self.transfer: TransferGroup | None = None
        self.sleeper = Sleeper(runner)

    @property
    def model_runner(self) -> "Worker":
        return self

    @property
    def model(self) -> "Worker":
        return self

    def named_parameters(self, *args, **kwargs):
        """The model's parameters (a CPU's packed projections have none left: their
        weights live in their methods' panels)."""
        return self.module.named_parameters(*args, **kwargs)

    def check_weights(self, weights: Iterable) -> None:
        """A ValueError naming every pair of `weights` that does not fit this model."""
        self.weights.check(weights)

    def load_weights(self, weights: Iterable) -> set[str]:
        """Writes new weights into this rank's model (see `rl/weights.py`); returns
        their names."""
        try:
            return self.weights.write(weights)
        finally:
            self.weights_changed()

    def init_weight_transfer_engine(
        self, init_info: dict, backend: str = "nccl"
    ) -> None:
        """Joins the trainer's weight-transfer group as rank `rank + rank_offset`, over
        NCCL on a GPU with the "nccl" backend, else over gloo."""
        missing = {"master_address", "master_port", "world_size"} - set(init_info)
        if missing:
            raise ValueError(f"init_info lacks {', '.join(sorted(missing))}")
        self.transfer = TransferGroup.join(
            init_info["master_address"],
            int(init_info["master_port"]),
            self.rank + int(init_info.get("rank_offset", 1)),
            int(init_info["world_size"]),
            nccl=backend == "nccl" and self.device.type == "cuda",
        )

    def update_weights(self, update_info: dict) -> set[str]:
        """Receives the weights `update_info` announces from the trainer, then writes
        them (all checked first: a refused batch is received whole, so that the trainer
        is not left waiting, and none of it written)."""
        if self.transfer is None:
            raise ValueError(
                "update_weights before init_weight_transfer_engine: join the trainer's "
                "group first"
            )
        try:
            return self.weights.write(receive(self.transfer, update_info, self.device))
        finally:
            self.weights_changed()

    def sleep(self, level: int) -> None:
        self.sleeper.sleep(level)
        self.weights_changed()

    def weights_changed(self) -> None:
        """Whatever the runner's extension computed from the weights (a vision model's
        encoder cache) is not served after new ones, nor kept through a sleep."""
        if self.runner.extension is not None:
            self.runner.extension.weights_changed()

    def wake_up(self, tags: list[str]) -> None:
        self.sleeper.wake_up(tags)

    def asleep(self) -> set[str]:
        return self.sleeper.asleep


def worker_of(runner, state: dict) -> Worker:
    """This rank's worker, kept in the rank's `state` (made at the first call)."""
    if "rl.worker" not in state:
        state["rl.worker"] = Worker(runner)
    return state["rl.worker"]


def rank_call(
    runner, state: dict, method: str | Callable, args: tuple, kwargs: dict
) -> object:
    """`method` on this rank's worker (made at the first call): a worker method's name,
    or a function of the worker."""
    worker = worker_of(runner, state)
    if callable(method):
        return method(worker, *args, **kwargs)
    function = getattr(worker, method, None)
    if not isinstance(method, str) or not callable(function):
        raise ValueError(
            f"collective_rpc: {method!r} is neither a function of the worker nor one "
            f"of its methods (load_weights, init_weight_transfer_engine, "
            f"update_weights, sleep, wake_up, ...)"
        )
    with torch.inference_mode():
        return function(*args, **kwargs)
