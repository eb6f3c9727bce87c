"""Decides which sequences run in the next step: prefill first, then decode with preemption."""
from collections import deque

from nanopaged.block_manager import BlockManager
from nanopaged.config import Config
from nanopaged.sequence import Sequence, SequenceStatus


class Scheduler:
    """Two queues: `waiting` (not yet prefilled, or preempted) and `running` (decoding).

    Each step is either all prefill or all decode. Prefill admits waiting sequences in order
    while the token budget, `max_num_seqs` and free blocks allow; a prompt that overflows the
    budget is prefilled in chunks over several steps. Otherwise every running sequence decodes
    one token; when the pool has no block for one, the newest running sequence is preempted:
    its blocks are freed and it goes back to the front of `waiting`, to be recomputed later
    (its prefix blocks often still sit in the cache).
    """

    def __init__(self, config: Config, block_manager: BlockManager, eos_token_ids: set[int]):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.block_manager = block_manager
        self.eos_token_ids = eos_token_ids
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def schedule(self) -> tuple[list[Sequence], bool]:
        """Returns the sequences of the next step and whether it is a prefill step. Sets each
        sequence's `num_scheduled_tokens`."""
        scheduled = self._schedule_prefill()
        if scheduled:
            return scheduled, True
        return self._schedule_decode(), False

    def _schedule_prefill(self) -> list[Sequence]:
        scheduled: list[Sequence] = []
        budget = self.max_num_batched_tokens
        while self.waiting and budget > 0 and len(self.running) + len(scheduled) < self.max_num_seqs:
            seq = self.waiting[0]
            if not seq.block_table:  # a partly prefilled sequence keeps its blocks
                if not self.block_manager.can_allocate(seq):
                    break
                self.block_manager.allocate(seq)
            seq.num_scheduled_tokens = min(len(seq) - seq.num_computed_tokens, budget)
            self.block_manager.cache_full_blocks(seq)
            budget -= seq.num_scheduled_tokens
            scheduled.append(seq)
            if not seq.samples_this_step:
                break  # the rest of its prompt is prefilled in the next step
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        return scheduled

    def _schedule_decode(self) -> list[Sequence]:
        scheduled: list[Sequence] = []
        while self.running and len(scheduled) < self.max_num_batched_tokens:
            seq = self.running.popleft()
            while not self.block_manager.can_append(seq):
                if self.running:
                    self._preempt(self.running.pop())
                else:
                    self._preempt(seq)
                    break
            else:
                seq.num_scheduled_tokens = 1
                self.block_manager.may_append(seq)
                scheduled.append(seq)
        self.running.extendleft(reversed(scheduled))
        return scheduled

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.deallocate(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def postprocess(self, seqs: list[Sequence], token_ids: list[int]) -> list[Sequence]:
        """Records the step's sampled tokens (one per sequence that sampled) and returns the
        sequences that finished."""
        sampled = iter(token_ids)
        finished = []
        for seq in seqs:
            seq.num_computed_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            if seq.num_computed_tokens < len(seq.token_ids):
                continue  # a prompt chunk: nothing sampled yet
            seq.append_token(next(sampled))
            reason = self._finish_reason(seq)
            if reason is not None:
                seq.finish_reason = reason
                seq.status = SequenceStatus.FINISHED
                self.block_manager.deallocate(seq)
                self.running.remove(seq)
                finished.append(seq)
        return finished

    def _finish_reason(self, seq: Sequence) -> str | None:
        params = seq.sampling_params
        if not params.ignore_eos and seq.token_ids[-1] in self.eos_token_ids:
            return "stop"
        if len(seq.token_ids) >= min(seq.num_prompt_tokens + params.max_tokens, self.max_model_len):
            return "length"
        return None

    def abort_all(self) -> None:
        """Drops every unfinished sequence and frees its blocks (after an interrupted step)."""
        for seq in (*self.waiting, *self.running):
            if seq.block_table:
                self.block_manager.deallocate(seq)
        self.waiting.clear()
        self.running.clear()
