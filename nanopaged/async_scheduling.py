"""Async scheduling (vLLM's `async_scheduling=True`, `--async-scheduling`): the host
schedules and launches step n+1 while step n runs on the device, and reads n's tokens
only then, so that the host's work between two steps (scheduling, inputs, outputs, text)
hides behind the device's instead of leaving it idle.

The core's loop and this one, side by side: the same calls, in another order.

    LLMEngineCore.step (the core)         AsyncEngine._step (this file)
    step = schedule()                     step = schedule()   # n's tokens PENDING
    launched = runner.launch(step)        in_flight.append(runner.launch(step, pending))
    sampled = runner.collect(launched)    sampled = runner.collect(in_flight.pop(0))
    apply(step, sampled)                  apply(n's step, sampled)

What the core keeps for this file alone: `sequence.PENDING` (a token not known yet,
which no hashed block holds); `ModelRunner.launch`'s `pending` and `step.Pending`
(input ids taken on the device from an earlier step's samples); `launch`, `compute`
and `collect` as three calls with `step.Launched` between them (the sync loop makes
them back to back); `BlockManager.commit(count)`, `cache_block` and `uncommitted`
(hashes committed step by step). On a CPU the device's part runs on a thread
(`cpu/device_thread.py`).

What overlap changes:

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
  `entered` of the journal). A failure or Ctrl-C in either step, or in the layer above
  between two calls, rolls both back (`abort_all`): every sequence ends, as the core
  does after a failed step, and the steps in flight are forgotten.
- The engine is finished only once it has read every step it launched: a call that
  runs it to its end leaves nothing running, and a wasted step's failure is that
  call's.
- A step whose sampling reads the tokens so far (penalties, bad words, logits
  processors, a grammar: `Sequence.logits_processors`) runs synchronously: while such a
  sequence is unfinished, each step is the core's, applied before the next is scheduled.
  Speculative decoding runs its own (synchronous) engine.
"""

import torch

from nanopaged.core.llm_engine import LLMEngineCore
from nanopaged.core.model_runner import ModelRunner
from nanopaged.core.sequence import PENDING, Sequence
from nanopaged.core.step import Launched, Pending, SamplerOutput, ScheduledStep


class AsyncEngine(LLMEngineCore):
    """The core engine with each step launched before the previous one's tokens are
    read. `step()` returns the step it read (the one launched before), or an empty step
    when it only launched one. Between two calls no sequence holds a pending token:
    the layer above sees only tokens that are known."""

    def __init__(self, config, runner: ModelRunner):
        super().__init__(config, runner)
        # the steps launched and not yet read, oldest first (at most two, one between
        # two calls)
        self.in_flight: list[Launched] = []
        # each sampling sequence of the oldest step in flight -> where its pending
        # token is
        self.pending_at: dict[Sequence, int] = {}
        self.entered = 0  # prefix-cache hashes the oldest step in flight entered

    def is_finished(self) -> bool:
        """Also waits for the step in flight: a call that runs until the engine is
        finished has read every step it launched (and its failure is the call's)."""
        return not self.in_flight and super().is_finished()

    def step(self) -> tuple[ScheduledStep, SamplerOutput]:
        try:
            return self._step()
        except BaseException:
            self.abort_all()
            raise

    def _step(self) -> tuple[ScheduledStep, SamplerOutput]:
        previous = self.in_flight[0] if self.in_flight else None
        self.pending_at = {}
        for seq in previous.step.sampling_seqs if previous else ():
            if seq.finish_reason is None:  # its sampled token, not known yet
                self.pending_at[seq] = len(seq.token_ids)
                seq.token_ids.append(PENDING)
        if any(seq.logits_processors for seq in self.unfinished()):
            # their sampling reads the tokens so far: the core's step, synchronous
            return self.read() if previous else super().step()
        step = self.schedule()
        if not step.seqs:
            if previous:
                return self.read()
            assert self.is_finished(), "sequences are queued but none can run"
            return step, SamplerOutput([])
        pending = self.pending(step, previous) if previous else None
        self.in_flight.append(self.runner.launch(step, pending))
        # a prompt that is never sampled ends with the step that runs it (its inputs
        # are built: its blocks may go)
        self.scheduler.finish(step.ended, "length")
        done = self.read() if previous else (ScheduledStep(), SamplerOutput([]))
        self.entered = len(self.block_manager.uncommitted)  # all the new step's
        return done

    def abort_all(self) -> None:
        """After a failure or an interrupt, in this step or in the layer above: no
        sequence keeps a pending token, the hashes of every step in flight are
        forgotten, and those steps are waited for (whatever they raise), so that
        nothing this engine launched still runs."""
        for seq, position in self.pending_at.items():
            del seq.token_ids[position:]
        dropped, self.in_flight, self.pending_at, self.entered = (
            self.in_flight,
            [],
            {},
            0,
        )
        super().abort_all()
        for launched in dropped:
            try:
                self.runner.collect(launched)
            except Exception:
                pass  # its tokens are dropped; its failure is the one raised already

    def pending(self, step: ScheduledStep, previous: Launched) -> Pending | None:
        """The input ids of `step` that `previous` samples: a sequence's last token,
        when the step runs it."""
        first = dict(zip(previous.step.sampling_seqs, previous.step.first_logit_rows))
        input_rows, token_indices, end = [], [], 0
        for seq, start, num_tokens in zip(step.seqs, step.starts, step.num_tokens):
            end += num_tokens
            if start + num_tokens == len(seq) and seq.token_ids[-1] == PENDING:
                input_rows.append(end - 1)
                token_indices.append(first[seq])
        return Pending(previous, input_rows, token_indices) if input_rows else None

    def read(self) -> tuple[ScheduledStep, SamplerOutput]:
        """Reads the oldest launched step's tokens, commits the hashes it entered and
        applies its tokens in place of the pending ones (those of a sequence ended
        meanwhile, aborted or at a stop string, are dropped: its row is left with no
        token)."""
        launched = self.in_flight.pop(0)
        sampled = self.runner.collect(launched)
        self.block_manager.commit(self.entered)
        self.entered = 0
        step, pending_at, self.pending_at = launched.step, self.pending_at, {}
        for seq, position in pending_at.items():
            del seq.token_ids[position:]
        tokens = [
            row if seq in pending_at else []
            for seq, row in zip(step.sampling_seqs, sampled.token_ids)
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


def single_runner(config) -> type[ModelRunner]:
    """The runner of a one-process engine with async scheduling: on a CPU, the one whose
    device's part runs on a thread (`cpu/device_thread.py`: nothing else there is
    asynchronous)."""
    if torch.device(config.device).type != "cpu":
        return ModelRunner
    from nanopaged.cpu.device_thread import DeviceThread

    return DeviceThread
