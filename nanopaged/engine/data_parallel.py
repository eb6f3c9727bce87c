"""Data parallelism: `LLM(model, data_parallel_size=N)` runs N replicas of the engine,
each in a process of its own (with its own GPUs, and itself possibly tensor-parallel),
each serving a share of the requests. The replicas share nothing: each has its own KV
cache and prefix cache.

Offline, `generate` checks every request here, deals the prompts out in turn (prompt i
to replica i mod N), runs the replicas at once and returns every output in order. A step
at a time, `add_request` sends a request to the replica with the fewest unfinished ones
and `step` steps every busy replica at once. The server routes each request itself
(`serving/router.py`).
"""

import multiprocessing as mp
import os
import signal
import threading
import weakref

import torch

from nanopaged.checkpoint import resolve_model
from nanopaged.engine.arg_utils import make_config, split_options
from nanopaged.engine.compat import VLLMEngineAPI
from nanopaged.engine.training import Driver, field_of
from nanopaged.inputs import InputProcessor, as_batch, check_priority, per_prompt
from nanopaged.outputs import EngineStats, RequestMetrics, RequestOutput
from nanopaged.parallel.tensor import (
    ParallelConfig,
    keep_inherited,
    start_child,
    start_method,
)
from nanopaged.sampling_params import SamplingParams


class ReplicaDied(RuntimeError):
    pass


class Replica:
    """One engine (an `engine_class`) in a child process, called through a pipe:
    `call(name, *args)` runs `engine.name(*args)` there and returns what it returns, or
    raises what it raised."""

    def __init__(
        self,
        engine_class: type,
        model: str,
        options: dict,
        index: int,
        num_replicas: int,
        gpus: list[str] | None,
    ):
        # a child forked after the parent counted its GPUs cannot choose among them:
        # spawn it
        method = "spawn" if gpus else start_method()
        context = mp.get_context(method)
        self.connection, child = context.Pipe()
        self.index, self.lock, self.dead = index, threading.Lock(), False
        self.owed = 1  # answers not yet read: the first says the engine is built
        # not a daemon: a tensor-parallel replica starts worker processes of its own
        self.process = context.Process(
            target=_serve,
            name=f"nanopaged-dp{index}",
            args=(
                child,
                engine_class,
                model,
                options,
                gpus,
                num_replicas,
                method == "fork",
            ),
        )
        start_child(self.process)
        child.close()

    def send(self, name: str, *args, **kwargs) -> None:
        # answers whose caller stopped waiting (Ctrl-C): not this call's
        while self.owed:
            try:
                self.receive()
            except ReplicaDied:
                raise
            except Exception:
                pass
        try:
            self.connection.send((name, args, kwargs))
        except OSError:
            raise self.died() from None
        self.owed += 1

    def receive(self):
        try:
            ok, value = self.connection.recv()
        except (EOFError, OSError):
            raise self.died() from None
        self.owed -= 1
        if not ok:
            raise value
        return value

    @property
    def alive(self) -> bool:
        return not self.dead and self.process.exitcode is None

    def died(self) -> ReplicaDied:
        """The error that says this replica's process died (now known to be dead)."""
        self.process.join(1)
        self.dead = True
        return ReplicaDied(
            f"data-parallel replica {self.index} died (exit code "
            f"{self.process.exitcode}); its traceback is printed above"
        )

    def call(self, name: str, *args, **kwargs):
        with self.lock:  # a server's engine loop and its /metrics may both call
            self.send(name, *args, **kwargs)
            return self.receive()

    def __getattr__(self, name: str):
        """`replica.step()` and the like: the engine's method, called in the replica."""
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda *args, **kwargs: self.call(name, *args, **kwargs)

    def close(self) -> None:
        if self.process.exitcode is None:
            try:  # read after any call it still runs
                self.connection.send(("close", (), {}))
            except OSError:
                pass
            self.process.join(30)
        if self.process.exitcode is None:
            self.process.kill()
            self.process.join()


def _serve(
    connection,
    engine_class: type,
    model: str,
    options: dict,
    gpus: list[str] | None,
    num_replicas: int,
    forked: bool,
) -> None:
    """The life of a replica's process: build the engine (on its own `gpus`), then run
    each call until told to close or the caller is gone."""
    keep_inherited(forked)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the caller's to handle
    if gpus:  # before CUDA starts in this process
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    else:  # share the cores; in a forked child more than one OpenMP thread would hang
        size = options.get("tensor_parallel_size", 1)
        torch.set_num_threads(
            1 if forked else max(1, os.cpu_count() // num_replicas // size)
        )
    try:
        engine = engine_class(model, **options)
    except BaseException as error:
        connection.send((False, error))
        return
    connection.send((True, None))
    while True:
        try:
            name, args, kwargs = connection.recv()
        except (EOFError, OSError):
            break  # the caller is gone
        if name == "close":
            break
        try:
            connection.send((True, getattr(engine, name)(*args, **kwargs)))
        except Exception as error:
            connection.send((False, error))
    engine.close()


def replica_trace(path: str | None, index: int) -> str | None:
    """Where replica `index` writes its trace: run.jsonl -> run.replica0.jsonl."""
    if path is None:
        return None
    stem, extension = os.path.splitext(path)
    return f"{stem}.replica{index}{extension}"


class DataParallelLLM(VLLMEngineAPI):
    """`LLM(model, data_parallel_size=N, **options)`: N replicas of the engine (each an
    `engine_class`); `generate`, `chat`, `stream`, the step-at-a-time calls and `stats`
    as a single engine's. With `trace`, each replica writes its own
    (`replica_trace`)."""

    def __init__(self, engine_class: type, model: str, **options):
        core, parallel, surface = split_options(model, options)
        self.config = make_config(resolve_model(model), core)
        self.parallel = ParallelConfig(**parallel)
        self.parallel.check(self.config)
        self.inputs = InputProcessor.for_checkpoint(self.config, surface)
        count = self.parallel.data_parallel_size
        replica_options = dict(options, data_parallel_size=1, seed=self.config.seed)
        self.replicas = [
            Replica(
                engine_class,
                model,
                dict(replica_options, trace=replica_trace(surface["trace"], i)),
                i,
                count,
                self._gpus(i),
            )
            for i in range(count)
        ]
        self._finalizer = weakref.finalize(self, _close_all, self.replicas)
        try:
            for replica in self.replicas:
                replica.receive()  # built, or its error
        except BaseException:
            self.close()
            raise
        self.inputs.num_blocks = min(
            s.num_blocks for s in self.replica_stats().values()
        )
        # unfinished ones added one at a time: where
        self.requests: dict[str, Replica] = {}

    def reset_prefix_cache(self) -> bool:
        """Forgets every replica's cached prefixes; False where requests run."""
        return all([replica.call("reset_prefix_cache") for replica in self.live()])

    def reset_mm_cache(self) -> None:
        self._on_every_replica("reset_mm_cache")

    def add_lora(self, lora_request) -> bool:
        """Reads and checks the adapter on every replica (LoRA adapters:
        `LLM.add_lora`)."""
        return all([replica.call("add_lora", lora_request) for replica in self.live()])

    def remove_lora(self, lora_id: int) -> bool:
        return any([replica.call("remove_lora", lora_id) for replica in self.live()])

    def list_loras(self) -> set[int]:
        return set().union(*[replica.call("list_loras") for replica in self.live()])

    # ---- RL (engine/training.py), on every replica ----

    @property
    def llm_engine(self):
        return self

    @property
    def model_executor(self) -> Driver:
        """vLLM's path to the model: its `load_weights` loads on every replica."""
        return Driver(self._load_weights)

    def _load_weights(self, weights: list) -> set[str]:
        self._check_idle("load_weights")
        answers = self._on_every_replica(
            "collective_rpc", "load_weights", None, (weights,)
        )
        return answers[0][0]

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None) -> list:
        """`method` on every rank of every replica (replica by replica, rank by
        rank): a function travels pickled."""
        answers = self._on_every_replica("collective_rpc", method, None, args, kwargs)
        return [result for answer in answers for result in answer]

    def sleep(self, level: int = 1, mode: str = "abort") -> list:
        finished = self._on_every_replica("sleep", level, mode)
        return [output for outputs in finished for output in outputs]

    def wake_up(self, tags: list[str] | None = None) -> None:
        self._on_every_replica("wake_up", tags)

    def is_sleeping(self) -> bool:
        return any(self._on_every_replica("is_sleeping"))

    def init_weight_transfer_engine(self, request) -> None:
        """Every replica joins the trainer's group, replica i's ranks after those of
        the replicas before it (`rank_offset` is the first replica's)."""
        info = field_of(request, "init_info")
        size = self.parallel.tensor_parallel_size
        first = int(info.get("rank_offset", 1)) if isinstance(info, dict) else 1
        self._on_every_replica(
            "init_weight_transfer_engine",
            each=lambda i: ({"init_info": dict(info, rank_offset=first + i * size)},),
        )

    def start_weight_update(self) -> None:
        self._on_every_replica("start_weight_update")

    def update_weights(self, request) -> None:
        self._on_every_replica("update_weights", request)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._on_every_replica("finish_weight_update", weight_version)

    def get_weight_version(self) -> str:
        return self._on_every_replica("get_weight_version")[0]

    def _on_every_replica(self, name: str, *args, each=None) -> list:
        """`name` on every live replica at once (a weight transfer's broadcast reaches
        them all together): sent to all, then their answers read, in order; `each(i)`
        gives replica i's own arguments."""
        live = self.live()
        for replica in live:
            replica.lock.acquire()
        try:
            for replica in live:
                replica.send(name, *(each(replica.index) if each else args))
            return [replica.receive() for replica in live]
        finally:
            for replica in live:
                replica.lock.release()

    def _gpus(self, index: int) -> list[str] | None:
        """Replica `index`'s share of the visible GPUs: `tensor_parallel_size` of
        them."""
        if self.config.device != "cuda":
            return None
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        gpus = (
            visible.split(",")
            if visible
            else list(map(str, range(torch.cuda.device_count())))
        )
        size = self.parallel.tensor_parallel_size
        return gpus[index * size : (index + 1) * size]

    def live(self) -> list[Replica]:
        """The replicas whose process has not died; a ReplicaDied when none is left."""
        live = [replica for replica in self.replicas if replica.alive]
        if not live:
            raise ReplicaDied("every data-parallel replica died; create a new engine")
        return live

    def generate(
        self,
        prompts,
        sampling_params=None,
        use_tqdm: bool = True,
        lora_request=None,
        priority=None,
    ) -> list:
        """Every request checked here first (one with images by its replica, which
        reads them); the i-th live replica runs prompts i, i + N, i + 2N, ...; the
        outputs come back in the prompts' order."""
        self._check_idle("generate")
        check_priority(priority)
        prompts, sampling_params = as_batch(prompts, sampling_params)
        for prompt, params in zip(prompts, sampling_params):
            # a prompt with images is read and checked by its replica alone
            if not (isinstance(prompt, dict) and "multi_modal_data" in prompt):
                self.inputs.make_request(prompt, params, None, ())
        adapters = per_prompt(lora_request, len(prompts))
        live = self.live()
        count = len(live)
        busy = [(i, replica) for i, replica in enumerate(live) if prompts[i::count]]
        for i, replica in busy:
            replica.send(
                "generate",
                prompts[i::count],
                sampling_params[i::count],
                use_tqdm and i == 0,
                adapters[i::count],
            )
        shares, error = {}, None
        for i, replica in busy:  # every answer is read, so that the pipes stay in step
            try:
                shares[i] = replica.receive()
            except BaseException as failure:
                error = error or failure
        if error is not None:
            raise error
        return [shares[i % count][i // count] for i in range(len(prompts))]

    def add_request(
        self,
        prompt,
        sampling_params=None,
        request_id: str | None = None,
        lora_request=None,
        priority: int = 0,
    ) -> str:
        """Queues a request on the least busy live replica. It is known here before the
        replica has it, so that an interrupt or a failure in between can withdraw it."""
        self._check_open()
        check_priority(priority)
        # vLLM's order
        if not isinstance(sampling_params, (SamplingParams, type(None))):
            request_id, prompt, sampling_params = prompt, sampling_params, request_id
        replica = min(self.live(), key=lambda r: (self.load(r), r.index))
        if request_id is None:
            request_id = next(
                str(i)
                for i in range(len(self.requests) + 1)
                if str(i) not in self.requests
            )
        elif request_id in self.requests:
            raise ValueError(
                f"request_id must be a string not in use, got {request_id!r}"
            )
        self.requests[request_id] = replica
        try:
            replica.call(
                "add_request",
                prompt,
                sampling_params,
                request_id=request_id,
                lora_request=lora_request,
            )
        except BaseException:
            self.requests.pop(request_id)
            if replica.alive:  # it may have taken the request before the interrupt
                replica.call("abort", request_id)
            raise
        return request_id

    def load(self, replica: Replica) -> int:
        return sum(owner is replica for owner in self.requests.values())

    def step(self) -> list:
        """One step of every live replica that has unfinished requests, run at once. The
        requests of a replica that died end, each with an output whose `error` says so;
        the others go on."""
        outputs = []
        for replica in self.replicas:  # one that died while idle
            if not replica.alive and self.load(replica):
                outputs += self._fail_requests_of(replica, replica.died())
        busy = [r for r in self.live() if self.load(r)]
        try:
            for replica in busy:
                replica.send("step")
            for replica in busy:
                try:
                    outputs += replica.receive()
                except ReplicaDied as died:
                    outputs += self._fail_requests_of(replica, died)
        # outputs may be lost: no request may wait for them forever
        except BaseException:
            self._abort_all()
            raise
        for output in outputs:
            if output.finished:
                self.requests.pop(output.request_id, None)
        return outputs

    def _fail_requests_of(
        self, replica: Replica, died: ReplicaDied
    ) -> list[RequestOutput]:
        failed = [
            request_id
            for request_id, owner in self.requests.items()
            if owner is replica
        ]
        return [
            RequestOutput(
                request_id,
                None,
                [],
                [],
                True,
                0,
                RequestMetrics(0.0),
                error=f"{type(died).__name__}: {died}",
            )
            for request_id in failed
        ]

    def abort(self, request_id: str) -> None:
        replica = self.requests.pop(request_id, None)
        if replica is not None and replica.alive:
            replica.call("abort", request_id)

    def _abort_all(self) -> None:
        for request_id in list(self.requests):
            try:
                self.abort(request_id)
            except ReplicaDied:
                pass

    def is_finished(self) -> bool:
        return not self.requests

    def replica_stats(self) -> dict[int, EngineStats]:
        """The stats of each live replica, by its index."""
        return {r.index: r.call("stats") for r in self.replicas if r.alive}

    def stats(self) -> EngineStats:
        return sum_stats(list(self.replica_stats().values()))


def sum_stats(every: list[EngineStats]) -> EngineStats:
    """The replicas' stats added up."""
    return EngineStats(
        *(sum(values) for values in zip(*(vars(s).values() for s in every)))
    )


def _close_all(replicas: list[Replica]) -> None:
    for replica in replicas:
        replica.close()
