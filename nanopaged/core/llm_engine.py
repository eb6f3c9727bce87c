"""The core engine loop: sequences in; schedule a step, run it, apply its samples."""

from nanopaged.core.block_manager import BlockManager
from nanopaged.core.config import Config
from nanopaged.core.model_runner import ModelRunner
from nanopaged.core.scheduler import Scheduler
from nanopaged.core.sequence import Sequence
from nanopaged.core.step import SamplerOutput, ScheduledStep


class LLMEngineCore:
    """The engine every request passes through (vLLM's `EngineCore`; vLLM's `LLMEngine`,
    the API above it, is nanopaged's `LLM`): `add(seq)`, then `step()` until
    `is_finished()`. Each step appends to each sampling sequence the tokens it sampled;
    a sequence ends ("stop") at one of its stop tokens, or ("length") at its max_tokens
    or the model's max_model_len, and its blocks are freed. A step that raises (an
    error, Ctrl-C) ends every sequence ("abort") and leaves the engine usable: the
    prefix cache keeps only K/V that was written, and every block is free again.

    Seam: a subclass may extend the two ends of a step, `schedule()` (what it runs) and
    `apply()` (what it sampled). Speculative decoding (`nanopaged/speculative.py`) adds
    proposals to the scheduled step, in slots `BlockManager.reserve` makes, and applies
    only those the model agrees with, giving the rest back with `BlockManager.trim`.
    Async scheduling (`nanopaged/async_scheduling.py`) replaces `step()` with one that
    calls the same `ModelRunner.launch` and `collect` in another order: it launches the
    next step before it collects the last."""

    def __init__(self, config: Config, runner: ModelRunner | None = None):
        self.config = config
        self.runner = runner or ModelRunner(config)
        self.block_manager = BlockManager(
            self.runner.num_kvcache_blocks,
            config.kvcache_block_size,
            config.enable_prefix_caching,
            self.runner.model.sliding_window,
        )
        self.scheduler = Scheduler(config, self.block_manager)
        self.num_generated_tokens = 0

    def add(self, seq: Sequence) -> None:
        """Queues a sequence (checked by the caller: it fits the model and the pool)."""
        self.scheduler.add(seq)

    def finish(self, seqs: list[Sequence], reason: str = "abort") -> None:
        """Ends sequences early, wherever they are, and frees their blocks."""
        self.scheduler.finish(seqs, reason)

    def stop(self, seq: Sequence, num_completion_tokens: int) -> None:
        """Ends `seq` as "stop" with its first `num_completion_tokens` tokens (where a
        stop string the layer above found ends), also when a step has just ended it."""
        self.scheduler.finish([seq], "stop")
        del seq.token_ids[seq.num_prompt_tokens + num_completion_tokens :]
        seq.finish_reason = "stop"

    def is_finished(self) -> bool:
        return self.scheduler.is_finished()

    def unfinished(self) -> list[Sequence]:
        """The sequences waiting or running."""
        return [*self.scheduler.waiting, *self.scheduler.running]

    def step(self) -> tuple[ScheduledStep, SamplerOutput]:
        """Schedules a step, runs it and applies what it sampled; returns the step and
        its output (no sequences and no tokens when nothing is queued)."""
        try:
            step = self.schedule()
            if not step.seqs:
                assert self.is_finished(), "sequences are queued but none can run"
                return step, SamplerOutput([])
            launched = self.runner.launch(step)
            sampled = self.runner.collect(launched)
            # the step's K/V is written: its hashes may be served
            self.block_manager.commit()
            return step, self.apply(step, sampled)
        except BaseException:
            self.abort_all()
            raise

    def schedule(self) -> ScheduledStep:
        """The next step (with no sequences when there is nothing to run), booked."""
        return self.scheduler.schedule()

    def apply(self, step: ScheduledStep, sampled: SamplerOutput) -> SamplerOutput:
        """Appends each row's tokens to its sequence, deciding after each whether it
        stops (the tokens after a stop are dropped); returns what it applied."""
        self.scheduler.finish(step.ended, "length")  # their prompt ran
        max_model_len = self.config.max_model_len
        for seq, token_ids in zip(step.sampling_seqs, sampled.token_ids):
            max_tokens = seq.sampling_params.max_tokens
            for token_id in token_ids:
                seq.token_ids.append(token_id)
                self.num_generated_tokens += 1
                if token_id in seq.stop_token_ids:
                    self.scheduler.finish([seq], "stop")
                    break
                if seq.num_completion_tokens == max_tokens or len(seq) >= max_model_len:
                    self.scheduler.finish([seq], "length")
                    break
        return sampled

    def abort_all(self) -> None:
        """After a failed or interrupted step: all sequences end, none half-run."""
        self.block_manager.rollback()
        self.scheduler.finish(self.unfinished(), "abort")
        self.block_manager.reclaim()
