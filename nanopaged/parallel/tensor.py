"""Tensor parallelism: one process per rank, joined by torch.distributed; and the
options of scaling out (`ParallelConfig`).

On one machine (the default), rank 0 lives in the caller's process: it schedules,
prepares each step's inputs and samples. Ranks 1..N-1 are worker processes it starts,
holding their own shards of the weights and of the KV cache. Every step, rank 0
broadcasts the step's inputs on a gloo group (a pickled object, so of any size) and all
ranks run the model; the all-reduces inside it join the shards.

Under torchrun (`distributed_executor_backend="external_launcher"`), on one machine or
many, every rank is a process torchrun started running the same script, and every rank
runs the whole engine: scheduling is replicated, not broadcast. It stays in step because
everything a rank decides follows from its inputs, which are the same everywhere: the
same requests in the same order, the same seeds, and logits that the collectives leave
identical on every rank (the LM head gathers all of them everywhere). So no step pays a
broadcast, and every rank returns the same outputs, as vLLM's torchrun_example.py
expects. A rank that dies breaks the next collective on the others, which raise (gloo)
or time out (NCCL) rather than wait forever.

Beside the steps, rank 0 may run a function on every rank (`MultiprocRunner.call`, a
pickled `RankCall`: RL's `collective_rpc`, new weights on each rank's shard).

The core sees none of this: the model's layers shard themselves over the ranks of the
default process group, and `make_runner` hands the engine a `ModelRunner` whose steps
run on every rank.
"""

import datetime
import gc
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nanopaged.checks import check_fields
from nanopaged.core.config import Config
from nanopaged.core.model_runner import ModelRunner, RunnerExtension
from nanopaged.core.sampler import Sampler
from nanopaged.core.step import (
    Launched,
    Pending,
    SamplerOutput,
    ScheduledStep,
    StepInputs,
)
from nanopaged.features import add_features

# Workers wait for rank 0's next message for as long as the caller leaves the engine
# idle.
IDLE_TIMEOUT = datetime.timedelta(days=365)
SHUTDOWN_TIMEOUT_S = 30
# Under torchrun, how long a rank waits in a collective for a peer that neither answers
# nor dies
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)


TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
BACKENDS = (None, "mp", "external_launcher")


class WorkerDied(RuntimeError):
    pass


@dataclass
class RankCall:
    """A function every rank runs, rank 0 too (`MultiprocRunner.call`; RL's
    `collective_rpc`): `function(runner, state, *args)`, with the rank's runner and a
    dict the rank keeps for such calls (a feature's state on that rank). It travels
    pickled (by `pickle.dumps`, on rank 0): a function defined at a module's top
    level."""

    function: Callable
    args: tuple = ()


@dataclass
class ParallelConfig:
    """How many processes run the engine. `tensor_parallel_size` ranks are processes the
    engine starts, meeting on `distributed_port` of 127.0.0.1 (a free port when None);
    with `distributed_executor_backend` "external_launcher" they are the processes
    torchrun started, on any machines. `data_parallel_size` replicas of the engine each
    serve a share of the requests (see `engine/data_parallel.py`)."""

    tensor_parallel_size: int = 1
    distributed_port: int | None = None
    distributed_executor_backend: str | None = None
    data_parallel_size: int = 1

    def __post_init__(self) -> None:
        check_fields(
            self,
            {"distributed_executor_backend": BACKENDS},
            ("tensor_parallel_size", "distributed_port", "data_parallel_size"),
        )
        if self.distributed_port is not None and self.distributed_port > 65535:
            raise ValueError(
                f"distributed_port must be in [1, 65535], got {self.distributed_port}"
            )

    @property
    def external_launcher(self) -> bool:
        return self.distributed_executor_backend == "external_launcher"

    def check(self, config: Config) -> None:
        """Whether the model can be split this way on this machine; picks a free
        port."""
        size = self.tensor_parallel_size
        # what the ranks split
        for name in (
            "num_attention_heads",
            "num_key_value_heads",
            "vocab_size",
            "intermediate_size",
            "moe_intermediate_size",
        ):
            value = getattr(config.hf_config, name, None)
            if value is not None and value % size:
                raise ValueError(
                    f"the model's {name}={value} is not divisible by "
                    f"tensor_parallel_size={size}"
                )
        if self.external_launcher:
            self._check_torchrun(config)
            return
        gpus = size * self.data_parallel_size
        if config.device == "cuda" and gpus > torch.cuda.device_count():
            raise ValueError(
                f"tensor_parallel_size={size} x data_parallel_size="
                f"{self.data_parallel_size} needs {gpus} GPUs but only "
                f"{torch.cuda.device_count()} CUDA GPU(s) are visible"
            )
        if size > 1 and self.distributed_port is None:
            self.distributed_port = free_port()

    def _check_torchrun(self, config: Config) -> None:
        missing = [name for name in TORCHRUN_VARIABLES if name not in os.environ]
        if missing:
            raise ValueError(
                f"distributed_executor_backend='external_launcher' runs under "
                f"torchrun, which sets {', '.join(missing)}: launch the script "
                f"with torchrun --nproc-per-node N [--nnodes M ...]"
            )
        world_size = int(os.environ["WORLD_SIZE"])
        if world_size != self.tensor_parallel_size or self.data_parallel_size != 1:
            raise ValueError(
                f"torchrun started {world_size} processes; with "
                f"distributed_executor_backend='external_launcher' they are the "
                f"tensor_parallel_size={self.tensor_parallel_size} ranks of one "
                f"engine (data_parallel_size must be 1: one torchrun job a replica)"
            )
        if (
            config.device == "cuda"
            and int(os.environ["LOCAL_RANK"]) >= torch.cuda.device_count()
        ):
            raise ValueError(
                f"LOCAL_RANK={os.environ['LOCAL_RANK']} but only "
                f"{torch.cuda.device_count()} CUDA GPU(s) are visible on this node"
            )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_runner(
    config: Config,
    parallel: ParallelConfig,
    extra_kv_bytes_per_block: int = 0,
    extension: RunnerExtension | None = None,
    sampler: type[Sampler] = Sampler,
    single: type[ModelRunner] = ModelRunner,
) -> ModelRunner:
    """The engine's model runner: in this process alone (a `single`, async
    scheduling's on a CPU), on every rank torchrun started, or on this process (rank 0)
    and the worker processes it starts. A feature's `extension` (LoRA's) takes part in
    every rank's runner: each worker gets a copy, made before rank 0's is used. Rank 0
    samples with `sampler`."""
    options = (extra_kv_bytes_per_block, extension, sampler)
    if parallel.tensor_parallel_size == 1:
        return single(config, *options)
    if parallel.external_launcher:
        return TorchrunRunner(config, *options)
    return MultiprocRunner(config, parallel, *options)


class TorchrunRunner(ModelRunner):
    """A rank of torchrun's job: it runs the whole engine, and leaves the group when
    closed."""

    def __init__(
        self,
        config: Config,
        extra_kv_bytes_per_block: int = 0,
        extension: RunnerExtension | None = None,
        sampler: type[Sampler] = Sampler,
    ):
        join_torchrun(config)
        super().__init__(config, extra_kv_bytes_per_block, extension, sampler)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class MultiprocRunner(ModelRunner):
    """Rank 0 of a tensor-parallel engine on one machine: it starts ranks 1..N-1
    (`run_worker`) and, every step, sends them the step's inputs before running its own
    shard."""

    def __init__(
        self,
        config: Config,
        parallel: ParallelConfig,
        extra_kv_bytes_per_block: int = 0,
        extension: RunnerExtension | None = None,
        sampler: type[Sampler] = Sampler,
    ):
        self.workers = []
        workers = start_workers(config, parallel, extension)
        try:
            with in_lockstep(workers):
                self.group = join_ranks(config, parallel, 0, workers)
                # each rank sizes its pool, captures graphs
                super().__init__(config, extra_kv_bytes_per_block, extension, sampler)
        except BaseException:
            stop_workers(workers, None)
            raise
        self.workers = workers

    def launch(self, step: ScheduledStep, pending: Pending | None = None) -> Launched:
        with in_lockstep(self.workers):
            return super().launch(step, pending)

    def collect(self, launched: Launched) -> SamplerOutput:
        with in_lockstep(self.workers):
            if self.device.type == "cuda":
                wait_for_gpu(self.workers)
            return super().collect(launched)

    def execute(
        self, inputs: StepInputs, pending: Pending | None = None
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        if self.workers:  # built: the workers wait for every step
            broadcast(inputs, self.group, self.workers)
        return super().execute(inputs, pending)

    def call(self, function: Callable, state: dict, *args) -> list:
        """`function(runner, state, *args)` on every rank (rank 0's with `state`, each
        worker's with its own); the results in rank order. A rank's exception is
        raised here, the first in rank order, after every rank has run."""
        try:  # pickled here, where a failure leaves the workers waiting in step
            message = pickle.dumps(RankCall(function, args))
        except (pickle.PicklingError, AttributeError, TypeError) as error:
            raise ValueError(
                f"a call on every rank travels pickled to the tensor-parallel workers, "
                f"and this one cannot ({error}): a function sent must be defined at a "
                f"module's top level"
            ) from None
        with in_lockstep(self.workers):
            broadcast(message, self.group, self.workers)
            try:
                results = [function(self, state, *args)]
            except Exception as error:
                results = [error]
            gathered = [None] * (len(self.workers) + 1)
            dist.gather_object(None, gathered, dst=0, group=self.group)
            results += gathered[1:]
        for result in results:
            if isinstance(result, Exception):
                raise result
        return results

    def close(self) -> None:
        """Stops the workers and leaves the process group."""
        workers, self.workers = self.workers, []
        stop_workers(workers, self.group)


def run_worker(
    config: Config,
    parallel: ParallelConfig,
    rank: int,
    extension: RunnerExtension | None,
) -> None:
    """The life of a tensor-parallel worker process: run every step rank 0 sends, until
    `None`."""
    add_features()  # a spawned worker starts with the core's registries empty
    group = join_ranks(config, parallel, rank, [])
    runner, state = ModelRunner(config, extension=extension), {}
    while (message := receive(group)) is not None:
        if not isinstance(message, bytes):  # a step's inputs
            runner.execute(message)
            continue
        try:  # a pickled RankCall
            call = pickle.loads(message)
            result = call.function(runner, state, *call.args)
        except Exception as error:  # raised on rank 0
            result = error
        dist.gather_object(result, None, dst=0, group=group)
    dist.destroy_process_group()


def start_workers(
    config: Config, parallel: ParallelConfig, extension: RunnerExtension | None
) -> list[mp.Process]:
    """Starts ranks 1..N-1, each running `run_worker`: forked, as vLLM's workers are,
    while this process has not initialised CUDA (so a script may create the engine at
    module level); else spawned (or as $VLLM_WORKER_MULTIPROC_METHOD says), and a
    spawned worker first imports the caller's script, which must then be a file that
    creates the engine under `if __name__ == "__main__":`."""
    if dist.is_initialized():
        raise RuntimeError(
            "this process already belongs to a torch.distributed group (another "
            "tensor-parallel engine?); close that engine before starting one"
        )
    method = start_method()
    script = getattr(sys.modules["__main__"], "__file__", None)
    if method == "spawn" and script is not None and not os.path.exists(script):
        raise ValueError(
            f"tensor_parallel_size > 1 after CUDA was initialised spawns workers "
            f"that import your script, and {script!r} is not a file they can "
            f"import (standard input?): save it to a file and run that"
        )
    context = mp.get_context(method)
    workers = []
    for rank in range(1, parallel.tensor_parallel_size):
        receiver, sender = context.Pipe(duplex=False)
        worker = context.Process(
            target=_worker_main,
            args=(config, parallel, rank, extension, sender, method == "fork"),
            daemon=True,
            name=f"nanopaged-tp{rank}",
        )
        start_child(worker)
        sender.close()  # the worker holds the only sending end now
        worker.errors = receiver
        workers.append(worker)
    return workers


def start_method() -> str:
    """How to start a child process that runs an engine or a rank: see
    `start_workers`."""
    return os.environ.get("VLLM_WORKER_MULTIPROC_METHOD") or (
        "spawn" if torch.cuda.is_initialized() else "fork"
    )


def start_child(process: mp.Process) -> None:
    """Starts `process` with the collector held off until it has: a forked child
    inherits this process's unreachable objects, whose finalizers must never run there
    (a torch.distributed group's waits forever for threads that only this process has;
    an engine's would close this process's workers), so the child first sets them
    aside (`keep_inherited`), and only then collects."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        process.start()
    finally:
        if collecting:
            gc.enable()


def keep_inherited(forked: bool) -> None:
    """The first thing a child started by `start_child` does: what a fork copied from
    its parent is never collected here."""
    if forked:
        gc.freeze()
        gc.enable()


def _worker_main(
    config: Config,
    parallel: ParallelConfig,
    rank: int,
    extension: RunnerExtension | None,
    errors: mp.connection.Connection,
    forked: bool,
) -> None:
    keep_inherited(forked)
    # Ctrl-C is rank 0's to handle: it stops the workers
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # share the cores with the other ranks; in a forked child the parent's OpenMP
    # threads do not exist, and more than one thread would hang
    if config.device == "cpu":
        share = max(1, torch.get_num_threads() // parallel.tensor_parallel_size)
        torch.set_num_threads(1 if forked else share)
    try:
        run_worker(config, parallel, rank, extension)
    except BaseException:
        errors.send(traceback.format_exc())  # for rank 0's error message
        raise


def join_ranks(
    config: Config, parallel: ParallelConfig, rank: int, workers: list[mp.Process]
) -> dist.ProcessGroup:
    """Joins this process to the others; returns the gloo group that carries rank 0's
    messages. The model's collectives run on the default group: NCCL on GPUs, gloo on
    CPU.

    Rank 0 serves the rendezvous store and waits until every worker has reached it,
    raising WorkerDied as soon as one exits instead."""
    size, port = parallel.tensor_parallel_size, parallel.distributed_port
    if rank == 0:
        try:
            store = dist.TCPStore(
                "127.0.0.1", port, size, is_master=True, wait_for_workers=False
            )
        except RuntimeError as error:
            raise ValueError(
                f"cannot listen on 127.0.0.1:{port} (distributed_port): {error}"
            ) from None
        while not store.check([f"worker{r}" for r in range(1, size)]):
            if (dead := _dead_worker(workers)) is not None:
                raise WorkerDied(_death_notice(dead))
            time.sleep(0.01)
    else:
        store = dist.TCPStore("127.0.0.1", port, size, is_master=False)
        store.set(f"worker{rank}", "here")
    backend = "gloo"
    if config.device == "cuda":
        torch.cuda.set_device(rank)
        backend = "nccl"
    dist.init_process_group(backend, store=store, rank=rank, world_size=size)
    return dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)


def join_torchrun(config: Config) -> None:
    """Joins the processes torchrun started: env:// rendezvous (MASTER_ADDR,
    MASTER_PORT, RANK, WORLD_SIZE), LOCAL_RANK picks this process's GPU. The collectives
    run on the default group (NCCL on GPUs, gloo on CPU)."""
    backend = "gloo"
    if config.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        backend = "nccl"
    if not dist.is_initialized():  # a script may have joined already
        dist.init_process_group(
            backend, init_method="env://", timeout=COLLECTIVE_TIMEOUT
        )


def broadcast(message, group: dist.ProcessGroup, workers: list[mp.Process]) -> None:
    check_workers(workers)
    dist.broadcast_object_list([message], src=0, group=group)


def receive(group: dist.ProcessGroup):
    box = [None]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def check_workers(workers: list[mp.Process]) -> None:
    dead = _dead_worker(workers)
    if dead is not None:
        raise WorkerDied(
            _death_notice(dead) + "; this engine cannot run any more: close it and "
            "create a new one"
        )


def _death_notice(worker: mp.Process) -> str:
    """What is known of a dead worker: its exit code and, if it got to send it, its
    traceback."""
    try:
        error = worker.errors.recv() if worker.errors.poll() else None
    except EOFError:
        error = None
    if error is None:
        return (
            f"tensor-parallel worker {worker.name} died (exit code {worker.exitcode}) "
            "before nanopaged ran in it; its traceback, if any, is printed above (a "
            'script that creates the engine outside `if __name__ == "__main__":`?)'
        )
    return (
        f"tensor-parallel worker {worker.name} died (exit code {worker.exitcode}):\n"
        f"{error}"
    )


def _dead_worker(workers: list[mp.Process], wait_s: float = 0) -> mp.Process | None:
    if wait_s and workers:
        mp.connection.wait([worker.sentinel for worker in workers], timeout=wait_s)
    return next((worker for worker in workers if worker.exitcode is not None), None)


@contextmanager
def in_lockstep(workers: list[mp.Process]) -> Iterator[None]:
    """Runs work that every rank does together. If it fails on rank 0, the workers are
    left somewhere inside it, out of step: kill them, so that the engine refuses further
    steps instead of running them out of step. A collective that failed because a worker
    died raises WorkerDied naming it."""
    try:
        yield
    except BaseException as error:
        # a collective can fail a moment before its dead peer's exit is seen
        dead = (
            _dead_worker(workers, wait_s=1) if isinstance(error, RuntimeError) else None
        )
        for worker in workers:
            worker.kill()
            worker.join()
        if dead is not None and not isinstance(error, WorkerDied):
            raise WorkerDied(_death_notice(dead)) from error
        raise


def wait_for_gpu(workers: list[mp.Process]) -> None:
    """Waits for this rank's queued GPU work. A dead worker never joins NCCL's
    collectives and a CUDA sync would then wait forever, so poll, checking the workers,
    instead of blocking."""
    done = torch.cuda.Event()
    done.record()
    while not done.query():
        check_workers(workers)


def stop_workers(workers: list[mp.Process], group: dist.ProcessGroup | None) -> None:
    """Tells the workers to exit (a `None` message on `group`) and waits for them, or,
    without a group or with a worker already gone, kills them. Then leaves the process
    group."""
    timeout = 0
    if workers and group is not None and all(w.exitcode is None for w in workers):
        try:
            dist.broadcast_object_list([None], src=0, group=group)
            timeout = SHUTDOWN_TIMEOUT_S
        except RuntimeError:
            pass  # a worker died meanwhile
    for worker in workers:
        worker.join(timeout)
        if worker.exitcode is None:
            worker.kill()
            worker.join()
    if dist.is_initialized():
        dist.destroy_process_group()
