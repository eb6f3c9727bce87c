"""Tensor parallelism: one process per rank, joined by torch.distributed.

On one machine (the default), rank 0 lives in the caller's process: it schedules, prepares
each step's inputs and samples. Ranks 1..N-1 are worker processes it starts, holding their own
shards of the weights and of the KV cache. Every step, rank 0 broadcasts the step's inputs on a
gloo group (a pickled object, so of any size) and all ranks run the model; the all-reduces
inside it join the shards.

Under torchrun (`distributed_executor_backend="external_launcher"`), on one machine or many,
every rank is a process torchrun started running the same script, and every rank runs the
whole engine: scheduling is replicated, not broadcast. It stays in step because everything a
rank decides follows from its inputs, which are the same everywhere: the same requests in the
same order, the same seeds, and logits that the collectives leave identical on every rank (the
LM head gathers all of them everywhere). So no step pays a broadcast, and every rank returns
the same outputs, as vLLM's torchrun_example.py expects. A rank that dies breaks the next
collective on the others, which raise (gloo) or time out (NCCL) rather than wait forever.
"""
import datetime
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from nanopaged.config import Config

# Workers wait for rank 0's next message for as long as the caller leaves the engine idle.
IDLE_TIMEOUT = datetime.timedelta(days=365)
SHUTDOWN_TIMEOUT_S = 30
# Under torchrun, how long a rank waits in a collective for a peer that neither answers nor dies
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)


class WorkerDied(RuntimeError):
    pass


def start_workers(config: Config, target: Callable[[Config, int], None]) -> list[mp.Process]:
    """Starts ranks 1..N-1, each running `target(config, rank)`: forked, as vLLM's workers are,
    while this process has not initialised CUDA (so a script may create the engine at module
    level); else spawned (or as $VLLM_WORKER_MULTIPROC_METHOD says), and a spawned worker first
    imports the caller's script, which must then be a file that creates the engine under
    `if __name__ == "__main__":`."""
    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a torch.distributed group (another "
                           "tensor-parallel engine?); close that engine before starting one")
    method = start_method()
    script = getattr(sys.modules["__main__"], "__file__", None)
    if method == "spawn" and script is not None and not os.path.exists(script):
        raise ValueError(f"tensor_parallel_size > 1 after CUDA was initialised spawns workers "
                         f"that import your script, and {script!r} is not a file they can "
                         f"import (standard input?): save it to a file and run that")
    context = mp.get_context(method)
    workers = []
    for rank in range(1, config.tensor_parallel_size):
        receiver, sender = context.Pipe(duplex=False)
        worker = context.Process(target=_worker_main,
                                 args=(target, config, rank, sender, method == "fork"),
                                 daemon=True, name=f"nanopaged-tp{rank}")
        worker.start()
        sender.close()  # the worker holds the only sending end now
        worker.errors = receiver
        workers.append(worker)
    return workers


def start_method() -> str:
    """How to start a child process that runs an engine or a rank: see `start_workers`."""
    return os.environ.get("VLLM_WORKER_MULTIPROC_METHOD") or (
        "spawn" if torch.cuda.is_initialized() else "fork")


def _worker_main(target: Callable[[Config, int], None], config: Config, rank: int,
                 errors: mp.connection.Connection, forked: bool) -> None:
    # Ctrl-C is rank 0's to handle: it stops the workers
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if config.device == "cpu":  # share the cores with the other ranks; in a forked child the
        # parent's OpenMP threads do not exist, and more than one thread would hang
        share = max(1, torch.get_num_threads() // config.tensor_parallel_size)
        torch.set_num_threads(1 if forked else share)
    try:
        target(config, rank)
    except BaseException:
        errors.send(traceback.format_exc())  # for rank 0's error message
        raise


def join_ranks(config: Config, rank: int, workers: list[mp.Process]) -> dist.ProcessGroup:
    """Joins this process to the others; returns the gloo group that carries rank 0's messages.
    The model's collectives run on the default group: NCCL on GPUs, gloo on CPU.

    Rank 0 serves the rendezvous store and waits until every worker has reached it, raising
    WorkerDied as soon as one exits instead."""
    size, port = config.tensor_parallel_size, config.distributed_port
    if rank == 0:
        try:
            store = dist.TCPStore("127.0.0.1", port, size, is_master=True, wait_for_workers=False)
        except RuntimeError as error:
            raise ValueError(f"cannot listen on 127.0.0.1:{port} (distributed_port): "
                             f"{error}") from None
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


def join_torchrun(config: Config) -> dist.ProcessGroup:
    """Joins the processes torchrun started: env:// rendezvous (MASTER_ADDR, MASTER_PORT, RANK,
    WORLD_SIZE), LOCAL_RANK picks this process's GPU. Returns a gloo group for the host's
    collectives; the model's run on the default group (NCCL on GPUs, gloo on CPU)."""
    backend = "gloo"
    if config.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        backend = "nccl"
    if not dist.is_initialized():  # a script may have joined already
        dist.init_process_group(backend, init_method="env://", timeout=COLLECTIVE_TIMEOUT)
    return dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)


def broadcast(message, group: dist.ProcessGroup, workers: list[mp.Process]) -> None:
    check_workers(workers)
    dist.broadcast_object_list([message], src=0, group=group)


def receive(group: dist.ProcessGroup):
    box = [None]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def min_over_ranks(value: int, group: dist.ProcessGroup) -> int:
    tensor = torch.tensor([value])
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=group)
    return int(tensor.item())


def check_workers(workers: list[mp.Process]) -> None:
    dead = _dead_worker(workers)
    if dead is not None:
        raise WorkerDied(_death_notice(dead) + "; this engine cannot run any more: close it and "
                         "create a new one")


def _death_notice(worker: mp.Process) -> str:
    """What is known of a dead worker: its exit code and, if it got to send it, its traceback."""
    try:
        error = worker.errors.recv() if worker.errors.poll() else None
    except EOFError:
        error = None
    if error is None:
        return (f"tensor-parallel worker {worker.name} died (exit code {worker.exitcode}) before "
                f"nanopaged ran in it; its traceback, if any, is printed above (a script that "
                f"creates the engine outside `if __name__ == \"__main__\":`?)")
    return f"tensor-parallel worker {worker.name} died (exit code {worker.exitcode}):\n{error}"


def _dead_worker(workers: list[mp.Process], wait_s: float = 0) -> mp.Process | None:
    if wait_s and workers:
        mp.connection.wait([worker.sentinel for worker in workers], timeout=wait_s)
    return next((worker for worker in workers if worker.exitcode is not None), None)


@contextmanager
def in_lockstep(workers: list[mp.Process]) -> Iterator[None]:
    """Runs work that every rank does together. If it fails on rank 0, the workers are left
    somewhere inside it, out of step: kill them, so that the engine refuses further steps
    instead of running them out of step. A collective that failed because a worker died
    raises WorkerDied naming it."""
    try:
        yield
    except BaseException as error:
        # a collective can fail a moment before its dead peer's exit is seen
        dead = _dead_worker(workers, wait_s=1) if isinstance(error, RuntimeError) else None
        for worker in workers:
            worker.kill()
            worker.join()
        if dead is not None and not isinstance(error, WorkerDied):
            raise WorkerDied(_death_notice(dead)) from error
        raise


def wait_for_gpu(workers: list[mp.Process]) -> None:
    """Waits for this rank's queued GPU work. A dead worker never joins NCCL's collectives and a
    CUDA sync would then wait forever, so poll, checking the workers, instead of blocking."""
    done = torch.cuda.Event()
    done.record()
    while not done.query():
        check_workers(workers)


def stop_workers(workers: list[mp.Process], group: dist.ProcessGroup | None) -> None:
    """Tells the workers to exit (a `None` message on `group`) and waits for them, or, without
    a group or with a worker already gone, kills them. Then leaves the process group."""
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
