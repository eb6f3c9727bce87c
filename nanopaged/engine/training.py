"""vLLM's `LLM` methods for reinforcement learning, as RL frameworks (TRL, verl,
OpenRLHF) call them: new weights in place, vLLM's weight transfer from a trainer in
another process, sleep mode, and `collective_rpc` on every rank. What they do lives in
`nanopaged/rl/` (`control.py` first), imported at the first call: a forker may delete
it, and these methods then say so.
"""

from collections.abc import Callable, Iterable


class Driver:
    """vLLM's path to rank 0's model, `llm.llm_engine.model_executor.driver_worker
    .model_runner.model`, which RL frameworks take to push weights: each step of it is
    this object, and its `load_weights` is the engine's `load` (on every rank and
    replica: checked first, the version advanced, the prefix cache forgotten)."""

    def __init__(self, load: Callable[[list], set[str]]):
        self._load = load

    @property
    def driver_worker(self) -> "Driver":
        return self

    model_executor = worker = model_runner = model = driver_worker

    def load_weights(self, weights: Iterable) -> set[str]:
        """Writes `(name, tensor)` pairs, by the checkpoint's names, into the model;
        returns their names."""
        return self._load(list(weights))


class TrainingAPI:
    """A mixin of `LLM`: `rl` (an `RLControl`, once an RL method is called) and
    `training_options` (`enable_sleep_mode` and the weight-transfer backend)."""

    @property
    def llm_engine(self):
        """vLLM's `llm.llm_engine`, which is the engine itself here."""
        return self

    @property
    def model_executor(self) -> Driver:
        return Driver(lambda weights: self._rl().load_weights(self, weights))

    def _rl(self):
        self._check_closed()  # not _check_open: what refuses generation may be ours
        if self.rl is None:
            from nanopaged.rl.control import RLControl

            self.rl = RLControl(*self.training_options)
        return self.rl

    def collective_rpc(
        self,
        method: str | Callable,
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict | None = None,
    ) -> list:
        """`method` on the worker of every rank (a worker method's name, or a function
        whose first argument is the worker, as vLLM's); the results in rank order. A
        function sent to tensor-parallel workers travels pickled: define it at a
        module's top level."""
        rl = self._rl()
        with rl.changing(self, set()):  # if the function writes weights
            return rl.call(self, method, args, kwargs)

    def init_weight_transfer_engine(self, request) -> None:
        """Joins every rank to the trainer's weight-transfer group: `request` is
        `{"init_info": {...}}` or vLLM's `WeightTransferInitRequest`, `init_info` its
        `master_address`, `master_port`, `world_size` and `rank_offset`."""
        self._rl().init_transfer(self, field_of(request, "init_info"))

    def start_weight_update(self) -> None:
        """Opens an update: until `finish_weight_update`, generation is refused."""
        self._rl().start_update(self)

    def update_weights(self, request) -> None:
        """Receives the weights `{"update_info": {"names", "dtype_names", "shapes"}}`
        announces from the trainer, on every rank, and writes them."""
        self._rl().update(self, field_of(request, "update_info"))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Closes the update: the version advances (named `weight_version`, if
        given)."""
        self._rl().finish_update(self, weight_version)

    def get_weight_version(self) -> str:
        """The version of the weights: its name, or the count of changes."""
        rl = self._rl()
        return rl.version_name or str(rl.version)

    def update_weight_version(self, new_version: str) -> None:
        """Names the current weights (their count is unchanged)."""
        self._rl().version_name = str(new_version)

    def sleep(self, level: int = 1, mode: str = "abort") -> list:
        """vLLM's sleep mode (`enable_sleep_mode=True`): level 1 frees the KV cache and
        keeps the weights (in host memory), level 2 frees both. Unfinished requests are
        aborted (`mode="abort"`), run to their end first (`"wait"`: their outputs are
        returned), or kept to run after waking (`"keep"`)."""
        return self._rl().sleep(self, level, mode)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Brings back what `tags` names ("weights", "kv_cache"; None: both)."""
        self._rl().wake_up(self, tags)

    def is_sleeping(self) -> bool:
        return self.rl is not None and bool(self.rl.asleep)


TRANSFER_BACKENDS = ("nccl", "gloo")


def transfer_backend(config: dict | None) -> str | None:
    """The backend `weight_transfer_config` names: "nccl" (vLLM's: NCCL on GPUs, gloo
    on CPUs) or "gloo"; None without a config (no weight transfer)."""
    if config is None:
        return None
    backend = config.get("backend", "nccl")
    if set(config) - {"backend"} or backend not in TRANSFER_BACKENDS:
        raise ValueError(
            f"weight_transfer_config takes backend, one of "
            f"{', '.join(TRANSFER_BACKENDS)}; got {config!r}"
        )
    return backend


def field_of(request, name: str) -> dict:
    """vLLM's request objects and their dicts alike: `request[name]` or
    `request.name`."""
    if isinstance(request, dict) and name in request:
        return request[name]
    if hasattr(request, name):
        return getattr(request, name)
    raise ValueError(f"expected {{{name!r}: {{...}}}}, got {request!r}")
