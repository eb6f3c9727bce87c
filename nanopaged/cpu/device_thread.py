"""A CPU's stand-in for a GPU's stream: the model runner whose device's part of each
step runs on a thread of its own, so that async scheduling (`async_scheduling.py`) can
overlap the host's work with the model's on a CPU too."""

import concurrent.futures
import os
import weakref

import torch

from nanopaged.core.model_runner import ModelRunner
from nanopaged.core.step import Launched, Pending, SamplerOutput


class DeviceThread(ModelRunner):
    """The model runner with its device's part of each step (`compute`: the model run
    and the sampling) on a thread of its own, one step after another, as a GPU runs a
    stream: on a CPU, where nothing else is asynchronous, what lets the host's work
    overlap the model's. The thread runs with the host's `torch.set_num_threads` as it
    was at each launch (torch keeps a count per thread). A forked child has none of its
    parent's threads: it starts its own, and runs there again the steps its parent had
    launched and not finished (a step's inputs and random numbers are fixed at launch:
    it computes the same)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pid: int | None = None  # the process whose thread `stream` runs
        self.stream: concurrent.futures.ThreadPoolExecutor | None = None
        # a launched step's work and its future, until it is collected (or dropped,
        # after a failure)
        self.running = weakref.WeakKeyDictionary()

    def compute(self, launched: Launched, pending: Pending | None) -> None:
        work = (launched, pending, torch.get_num_threads())
        self.running[launched] = work, self.thread().submit(self._compute, *work)

    def _compute(self, launched: Launched, pending: Pending | None, threads: int):
        if torch.get_num_threads() != threads:  # the program's choice, at launch
            torch.set_num_threads(threads)
        with torch.inference_mode():  # a thread's own setting
            super().compute(launched, pending)

    def thread(self) -> concurrent.futures.ThreadPoolExecutor:
        """This process's device thread (started anew in a forked child)."""
        if self.pid != os.getpid():
            self.pid = os.getpid()
            self.stream = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="nanopaged-device"
            )
            for launched, (work, future) in list(self.running.items()):
                if not future.done():  # its parent's thread was running it
                    self.running[launched] = (
                        work,
                        self.stream.submit(self._compute, *work),
                    )
        return self.stream

    def collect(self, launched: Launched) -> SamplerOutput:
        self.thread()
        _, future = self.running.pop(launched)
        future.result()
        return super().collect(launched)

    def close(self) -> None:
        if self.stream is not None and self.pid == os.getpid():
            self.stream.shutdown(cancel_futures=True)
        super().close()
