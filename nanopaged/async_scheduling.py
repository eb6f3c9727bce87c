"""Async scheduling (vLLM's `async_scheduling=True`, `--async-scheduling`): the host
schedules and launches step n+1 while step n runs on the device, and reads n's tokens
only then, so that the host's work between two steps (scheduling, inputs, outputs, text)
hides behind the device's instead of leaving it idle.

Read the core's loop first (`LLMEngine.step`: schedule a step, run it, apply what it
sampled); this file is what overlap changes in it, and nothing else does:

- Step n+1 is scheduled before n's tokens are known. While it is scheduled and
  launched, each sequence that n samples holds a `PENDING` token for it (so that
  lengths, positions and blocks are right), and n+1 takes that token as an input id on
  the device, from n's samples (`Pending`): no wait. A block holding a pending token is
  hashed once the token is known.
- n's tokens are read after n+1 is launched, then applied in place of the pending ones
  (the core's `apply`: stop tokens, `max_tokens`, freeing). A sequence that ended at n
  has one wasted row in n+1, whose token is dropped. Its blocks are freed at once: the
  device runs n+1 before any later step (a GPU's one stream; on a CPU, `DeviceThread`'s
  one thread), so a later owner's K/V always lands after the wasted row's.
- The prefix cache commits a step's hashes once that step has finished (the first
  `entered` of the journal); a failure or Ctrl-C in either step rolls both back and
  ends every sequence, as the core does after a failed step.
- A step whose sampling reads the tokens so far (penalties, bad words, logits
  processors, a grammar: `Sequence.logits_processors`) runs synchronously: while such a
  sequence is unfinished, each step is the core's, applied before the next is scheduled.
  Speculative decoding runs its own (synchronous) engine.
"""

import concurrent.futures
import weakref

import torch

from nanopaged.core.llm_engine import LLMEngine
from nanopaged.core.model_runner import ModelRunner
from nanopaged.core.sequence import PENDING, Sequence
from nanopaged.core.step import Launched, Pending, SamplerOutput, ScheduledStep


class AsyncEngine(LLMEngine):
    """The core engine with each step launched before the previous one's tokens are
    read. `step()` returns the step it read (the one launched before), or an empty step
    when it only launched one. Between two calls no sequence holds a pending token:
    the layer above sees only tokens that are known."""

    def __init__(self, config, runner: ModelRunner):
        super().__init__(config, runner)
        self.in_flight: Launched | None = None
        # each sampling sequence of the step in flight -> where its pending token is
        self.pending_at: dict[Sequence, int] = {}
        self.entered = 0  # prefix-cache hashes the step in flight entered

    def step(self) -> tuple[ScheduledStep, SamplerOutput]:
        try:
            return self._step()
        except BaseException:
            for seq, position in self.pending_at.items():
                del seq.token_ids[position:]
            self.in_flight, self.pending_at = None, {}
            self.abort_all()  # both steps' hashes forgotten, every sequence ended
            raise

    def _step(self) -> tuple[ScheduledStep, SamplerOutput]:
        previous, self.in_flight = self.in_flight, None
        self.pending_at = {}
        for seq in previous.step.samplers if previous else ():
            if seq.finish_reason is None:  # its sampled token, not known yet
                self.pending_at[seq] = len(seq.token_ids)
                seq.token_ids.append(PENDING)
        if any(seq.logits_processors for seq in self.unfinished()):
            # their sampling reads the tokens so far: the core's step, synchronous
            return self.read(previous) if previous else super().step()
        step = self.schedule()
        if not step.seqs:
            if previous:
                return self.read(previous)
            assert self.is_finished(), "sequences are queued but none can run"
            return step, SamplerOutput([])
        pending = self.pending(step, previous) if previous else None
        launched = self.runner.launch(step, pending)
        # a prompt that is never sampled ends with the step that runs it (its inputs
        # are built: its blocks may go)
        self.scheduler.finish(step.ended, "length")
        done = self.read(previous) if previous else (ScheduledStep(), SamplerOutput([]))
        self.in_flight = launched
        self.entered = len(self.block_manager.uncommitted)  # all the new step's
        return done

    def pending(self, step: ScheduledStep, previous: Launched) -> Pending | None:
        """The input ids of `step` that `previous` samples: a sequence's last token,
        when the step runs it."""
        row_of = dict(zip(previous.step.samplers, previous.step.first_rows))
        input_rows, rows, end = [], [], 0
        for seq, start, num_tokens in zip(step.seqs, step.starts, step.num_tokens):
            end += num_tokens
            if start + num_tokens == len(seq) and seq.token_ids[-1] == PENDING:
                input_rows.append(end - 1)
                rows.append(row_of[seq])
        return Pending(previous, input_rows, rows) if rows else None

    def read(self, launched: Launched) -> tuple[ScheduledStep, SamplerOutput]:
        """Reads a launched step's tokens, commits the hashes it entered and applies
        its tokens in place of the pending ones (those of a sequence ended meanwhile,
        aborted or at a stop string, are dropped)."""
        sampled = self.runner.collect(launched)
        self.block_manager.commit(self.entered)
        self.entered = 0
        step, pending_at, self.pending_at = launched.step, self.pending_at, {}
        for seq, position in pending_at.items():
            del seq.token_ids[position:]
        tokens = [
            row if seq in pending_at else []
            for seq, row in zip(step.samplers, sampled.token_ids)
        ]
        sampled = SamplerOutput(tokens, sampled.logits, sampled.hidden_states)
        self.apply(step, sampled)
        for seq, position in pending_at.items():
            self.cache_filled(seq, position)
        return step, sampled

    def cache_filled(self, seq: Sequence, position: int) -> None:
        """Enters in the prefix cache the block that the token now known at `position`
        filled, if a step has computed (or computes) its K/V: it held a pending token
        when its step was scheduled."""
        block_size = self.block_manager.block_size
        full = (position + 1) % block_size == 0
        if full and seq.finish_reason is None and position < seq.num_computed_tokens:
            self.block_manager.cache_block(seq, position // block_size)


class DeviceThread(ModelRunner):
    """The model runner with its device's part of each step (`start`: the model run and
    the sampling) on a thread of its own, one step after another, as a GPU runs a
    stream: on a CPU, where nothing else is asynchronous, what lets the host's work
    overlap the model's."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.stream = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="nanopaged-device"
        )
        # a launched step's work, until it is collected (or dropped, after a failure)
        self.running = weakref.WeakKeyDictionary()

    def start(self, launched: Launched, pending: Pending | None) -> None:
        self.running[launched] = self.stream.submit(self._start, launched, pending)

    def _start(self, launched: Launched, pending: Pending | None) -> None:
        with torch.inference_mode():  # a thread's own setting
            super().start(launched, pending)

    def collect(self, launched: Launched) -> SamplerOutput:
        self.running.pop(launched).result()
        return super().collect(launched)

    def close(self) -> None:
        self.stream.shutdown(cancel_futures=True)
        super().close()


def single_runner(config) -> type[ModelRunner]:
    """The runner of a one-process engine with async scheduling: on a CPU, the one whose
    device's part runs on a thread (nothing else there is asynchronous)."""
    return DeviceThread if torch.device(config.device).type == "cpu" else ModelRunner
