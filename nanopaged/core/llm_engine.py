"""The core engine loop: sequences in; schedule a step, run it, apply what it sampled."""
from nanopaged.core.block_manager import BlockManager
from nanopaged.core.config import Config
from nanopaged.core.model_runner import ModelRunner
from nanopaged.core.scheduler import Scheduler
from nanopaged.core.sequence import Sequence
from nanopaged.core.step import SamplerOutput, ScheduledStep


class LLMEngine:
    """The engine every request passes through: `add(seq)`, then `step()` until
    `is_finished()`. Each step appends to each sampling sequence the tokens it sampled; a
    sequence ends ("stop") at one of its stop tokens, or ("length") at its max_tokens or the
    model's max_model_len, and its blocks are freed. A step that raises (an error, Ctrl-C) ends
    every sequence ("abort") and leaves the engine usable: the prefix cache keeps only K/V that
    was written, and every block is free again.
    """

    def __init__(self, config: Config, runner: ModelRunner | None = None):
        self.config = config
        self.runner = runner or ModelRunner(config)
        self.block_manager = BlockManager(self.runner.num_kvcache_blocks, config.kvcache_block_size,
                                          config.enable_prefix_caching,
                                          self.runner.model.sliding_window)
        proposer = self.runner.proposer
        self.scheduler = Scheduler(config, self.block_manager,
                                   proposer.num_speculative_tokens if proposer else 0,
                                   proposer.disable_by_batch_size if proposer else None)
        self.num_generated_tokens = 0

    def add(self, seq: Sequence) -> None:
        """Queues a sequence (checked by the caller: it fits the model and the pool)."""
        self.scheduler.add(seq)

    def finish(self, seqs: list[Sequence], reason: str = "abort") -> None:
        """Ends sequences early, wherever they are, and frees their blocks."""
        self.scheduler.finish(seqs, reason)

    def is_finished(self) -> bool:
        return self.scheduler.is_finished()

    def step(self) -> tuple[ScheduledStep, SamplerOutput]:
        """Schedules a step, runs it and applies what it sampled; returns the step and its
        output (no sequences and no tokens when nothing is queued)."""
        try:
            step = self.scheduler.schedule()
            if not step.seqs:
                assert self.is_finished(), "sequences are queued but none can run"
                return step, SamplerOutput([])
            sampled = self.runner.run(step)
            self.block_manager.commit()  # the step's K/V is written: its hashes may be served
            self._apply(step, sampled)
            return step, sampled
        except BaseException:
            self.abort_all()
            raise

    def _apply(self, step: ScheduledStep, sampled: SamplerOutput) -> None:
        """Appends each row's tokens to its sequence, deciding after each whether it stops (the
        tokens after a stop are dropped); gives back the slots of rejected proposals."""
        for seq, token_ids in zip(step.samplers, sampled.token_ids):
            for token_id in token_ids:
                seq.token_ids.append(token_id)
                self.num_generated_tokens += 1
                reason = self._stop_reason(seq)
                if reason is not None:
                    self.scheduler.finish([seq], reason)
                    break
        for i in step.lookahead_slots:
            if step.seqs[i].finish_reason is None:
                self.block_manager.trim(step.seqs[i])

    def _stop_reason(self, seq: Sequence) -> str | None:
        if seq.token_ids[-1] in seq.stop_token_ids:
            return "stop"
        if (seq.num_completion_tokens == seq.sampling_params.max_tokens
                or len(seq) >= self.config.max_model_len):
            return "length"
        return None

    def abort_all(self) -> None:
        """After a failed or interrupted step: every sequence ends, nothing half-run stays."""
        self.block_manager.rollback()
        self.scheduler.finish([*self.scheduler.waiting, *self.scheduler.running], "abort")
        self.block_manager.reclaim()
