"""The engine's side of an RL loop, above the ranks: what `LLM`'s RL methods do
(`engine/training.py` names them, as vLLM's). It keeps what belongs to the whole
engine, not to a rank:

- the weight version, a counter that every change of weights advances (and a name for
  it, `finish_weight_update(weight_version=...)`): each `RequestOutput` carries the
  version that made it, so that a trainer can drop stale rollouts;
- the prefix cache, forgotten after every change of weights and every sleep: no K/V
  computed with old weights, or lost in sleep, is ever served;
- what refuses generation meanwhile: a weight update under way (between
  `start_weight_update` and `finish_weight_update`), a sleeping KV cache or weights, and
  weights that `sleep(level=2)` discarded and no update has brought back whole.

Changes of weights and sleep wait for an idle engine: one with unfinished requests
refuses them (`sleep` handles its requests first, as its `mode` says).
"""

import contextlib
from collections.abc import Callable, Iterable

from nanopaged.parallel.tensor import MultiprocRunner
from nanopaged.rl.transfer import check_update_info
from nanopaged.rl.worker import Worker, rank_call, worker_of

SLEEP_MODES = ("abort", "wait", "keep")
TAGS = ("weights", "kv_cache")


def on_every_rank(runner, state: dict, function: Callable, *args) -> list:
    """`function(runner, state, *args)` on every rank of the engine, rank 0 with
    `state`; the results in rank order."""
    if isinstance(runner, MultiprocRunner):
        return runner.call(function, state, *args)
    return [function(runner, state, *args)]


class RLControl:
    """The RL state of one engine (see the module's docstring). `sleep_mode` and
    `transfer_backend` are the engine's options (`enable_sleep_mode`,
    `weight_transfer_config`)."""

    def __init__(self, sleep_mode: bool, transfer_backend: str | None):
        self.sleep_mode = sleep_mode
        self.transfer_backend = transfer_backend
        self.version = 0
        self.version_name: str | None = None
        self.updating = False
        self.rank0: dict = {}  # rank 0's state for `rank_call`
        self.asleep: set[str] = set()
        self.discarded = False  # sleep(2) dropped the weights
        self.refilled: set[str] = set()  # the checkpoint's names written since

    # ---- on every rank ----

    def call(self, llm, method: str | Callable, args=(), kwargs=None) -> list:
        """vLLM's `collective_rpc`: `method` on every rank's worker."""
        runner = getattr(llm.engine.runner, "runner", llm.engine.runner)  # traced
        return on_every_rank(
            runner, self.rank0, rank_call, method, tuple(args), kwargs or {}
        )

    def worker(self, llm) -> Worker:
        """Rank 0's worker."""
        return worker_of(
            getattr(llm.engine.runner, "runner", llm.engine.runner), self.rank0
        )

    # ---- what refuses generation ----

    def refusal(self) -> str | None:
        """Why the engine cannot generate now, or None."""
        if self.updating:
            return (
                "the weights are being updated (start_weight_update() was called): "
                "call finish_weight_update() before generating"
            )
        if self.asleep:
            return (
                f"the engine is asleep ({' and '.join(sorted(self.asleep))}): "
                f"wake_up() before generating"
            )
        if self.discarded:
            return (
                "sleep(level=2) discarded the weights and no update has brought them "
                "all back: load new weights (load_weights or a weight update) before "
                "generating"
            )
        return None

    def check_idle(self, llm, what: str) -> None:
        if llm.requests or not llm.engine.is_finished():
            raise ValueError(
                f"{what} waits for an idle engine: {len(llm.requests)} requests are "
                f"unfinished; run step() until is_finished() or abort() them"
            )

    # ---- new weights ----

    def load_weights(self, llm, weights: Iterable) -> set[str]:
        """New weights on every rank, checked first on rank 0 (nothing written if any
        is refused); the version advances."""
        self.check_idle(llm, "load_weights")
        if self.asleep:
            raise ValueError(
                "the engine is asleep: wake_up() (its weights at least) before "
                "loading weights"
            )
        weights = list(weights)
        self.worker(llm).check_weights(weights)
        with self.changing(llm, {name for name, _ in weights}):
            return self.call(llm, "load_weights", (weights,))[0]

    @contextlib.contextmanager
    def changing(self, llm, names: set[str]):
        """Around a write of weights: once any was written (a Ctrl-C in the middle
        finishes the writing first), the engine takes note that they changed."""
        writer = self.worker(llm).weights
        writes = writer.writes
        try:
            yield
        finally:
            if writer.writes != writes:
                self.changed(llm, names)

    def changed(self, llm, names: set[str]) -> None:
        """After new weights: no prefix computed with the old ones is served again, and
        outside an update the version advances."""
        llm.engine.block_manager.reset_prefix_cache()
        if self.discarded:
            writer = self.worker(llm).weights
            self.refilled |= {writer.checkpoint_name(name) for name in names}
            expected = writer.expected_names()
            self.discarded = not expected <= self.refilled
        if not self.updating:
            self.version += 1
            self.version_name = None

    # ---- vLLM's weight transfer ----

    def init_transfer(self, llm, init_info: dict) -> None:
        if self.transfer_backend is None:
            raise ValueError(
                "weight transfer is not configured: create the engine with "
                "weight_transfer_config={'backend': 'nccl'} (--weight-transfer-config)"
            )
        if not isinstance(init_info, dict):
            raise ValueError(
                f"init_info must be a dict, got {type(init_info).__name__}"
            )
        self.call(
            llm, "init_weight_transfer_engine", (init_info, self.transfer_backend)
        )

    def start_update(self, llm) -> None:
        self.check_idle(llm, "start_weight_update")
        if self.updating:
            raise ValueError(
                "start_weight_update() twice: finish_weight_update() first"
            )
        self.updating = True

    def update(self, llm, update_info: dict) -> set[str]:
        if not self.updating:
            raise ValueError("update_weights() needs start_weight_update() first")
        names = {name for name, _, _ in check_update_info(update_info)}
        with self.changing(llm, names):
            return self.call(llm, "update_weights", (update_info,))[0]

    def finish_update(self, llm, weight_version: str | None) -> None:
        if not self.updating:
            raise ValueError("finish_weight_update() without start_weight_update()")
        self.updating = False
        self.version += 1
        self.version_name = weight_version

    # ---- sleep ----

    def sleep(self, llm, level: int, mode: str) -> list:
        """Puts every rank to sleep once its requests are dealt with as `mode` says;
        returns the outputs of those that `mode="wait"` ran to their end."""
        if not self.sleep_mode:
            raise ValueError(
                "sleep mode is off: create the engine with enable_sleep_mode=True"
            )
        if level not in (1, 2):
            raise ValueError(f"level must be 1 or 2, got {level!r}")
        if mode not in SLEEP_MODES:
            raise ValueError(
                f"mode must be one of {', '.join(SLEEP_MODES)}, got {mode!r}"
            )
        if self.asleep:
            raise ValueError("the engine is asleep already: wake_up() first")
        finished = []
        if mode == "abort":
            for request_id in list(llm.requests):
                llm.abort(request_id)
            llm.engine.abort_all()  # a step still in flight (async scheduling)
        elif mode == "wait":
            while not llm.is_finished():
                finished += [output for output in llm.step() if output.finished]
        else:
            self.keep(llm)
        self.call(llm, "sleep", (level,))
        llm.engine.block_manager.reset_prefix_cache()
        self.asleep = set(self.worker(llm).asleep())
        if level == 2:
            self.discarded, self.refilled = True, set()
        return finished

    def keep(self, llm) -> None:
        """mode="keep": the requests stay; the running ones give back their blocks and
        are computed again after waking (the KV cache is about to go)."""
        if getattr(llm.engine, "in_flight", None):
            raise ValueError(
                "sleep(mode='keep') with async scheduling and a step in flight: use "
                "mode='abort' or 'wait'"
            )
        llm.engine.scheduler.preempt_all()

    def wake_up(self, llm, tags: list[str] | None) -> None:
        tags = list(TAGS if tags is None else tags)
        unknown = set(tags) - set(TAGS)
        if unknown:
            raise ValueError(
                f"wake_up tags are {', '.join(TAGS)}; got {', '.join(sorted(unknown))}"
            )
        self.call(llm, "wake_up", (tags,))
        self.asleep = set(self.worker(llm).asleep())
