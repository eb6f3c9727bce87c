"""Decides which sequences run in the next step, and records what each step sampled."""
from collections import deque

from nanopaged.block_manager import BlockManager
from nanopaged.config import Config
from nanopaged.sequence import Sequence


class Scheduler:
    """Two queues: `waiting` (not yet prefilled, or preempted) and `running` (decoding).

    Prefill admits waiting sequences in order while the token budget
    (`max_num_batched_tokens`), `max_num_seqs` and free blocks allow; only the last prompt of a
    step can overflow the budget, and is then prefilled in chunks over several steps. Decode
    gives each running sequence one token, oldest first, up to the token budget; when the
    pool has no block for one, the newest running sequence is preempted: its blocks are freed
    and it goes back to the front of `waiting` (behind a prompt being prefilled in chunks), to be
    recomputed later (its prefix blocks often still sit in the cache).

    The `prefill-first` policy runs a prefill step whenever a prompt can be admitted, else a
    decode step. The `mixed` policy (as vLLM V1 and Sarathi-Serve) decodes every running
    sequence in each step and spends the rest of the budget on prefill chunks, so that a long
    prompt never stalls the others' decoding.
    """

    def __init__(self, config: Config, block_manager: BlockManager):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.mixed = config.scheduling == "mixed"
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def schedule(self) -> tuple[list[Sequence], bool]:
        """Returns the sequences of the next step (none when there is nothing to run) and whether
        the step runs prompt tokens (a ragged batch) rather than only decodes. Sets each
        sequence's `num_scheduled_tokens`."""
        if self.mixed:
            decode = self._schedule_decode()
            prefill = self._schedule_prefill(self.max_num_batched_tokens - len(decode))
            return decode + prefill, bool(prefill)
        prefill = self._schedule_prefill(self.max_num_batched_tokens)
        return (prefill, True) if prefill else (self._schedule_decode(), False)

    def _schedule_prefill(self, budget: int) -> list[Sequence]:
        scheduled: list[Sequence] = []
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if not seq.block_table:  # a partly prefilled sequence keeps its blocks
                num_seqs = len(self.running) + 1 + len(seq.forks)
                if num_seqs > self.max_num_seqs or not self.block_manager.can_allocate(seq):
                    break
                self.block_manager.allocate(seq)
            seq.num_scheduled_tokens = min(len(seq) - seq.num_computed_tokens, budget)
            self.block_manager.cache_full_blocks(seq)
            budget -= seq.num_scheduled_tokens
            scheduled.append(seq)
            if not seq.samples_this_step:
                break  # the rest of its prompt is prefilled in the next step
            self.running.append(self.waiting.popleft())
        return scheduled

    def _schedule_decode(self) -> list[Sequence]:
        scheduled: list[Sequence] = []
        while self.running and len(scheduled) < self.max_num_batched_tokens:
            seq = self.running.popleft()
            if self._make_room(seq):
                seq.num_scheduled_tokens = 1
                self.block_manager.may_append(seq)
                scheduled.append(seq)
        self.running.extendleft(reversed(scheduled))
        return scheduled

    def _make_room(self, seq: Sequence) -> bool:
        """Preempts the newest running sequences until `seq` can append a token; preempts `seq`
        itself (and returns False) when it is the only one left."""
        while not self.block_manager.can_append(seq):
            if not self.running:
                self._preempt(seq)
                return False
            self._preempt(self.running.pop())
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.deallocate(seq)
        # first in line, but behind a prompt being prefilled in chunks: that one holds its blocks
        self.waiting.insert(1 if self.waiting and self.waiting[0].block_table else 0, seq)
        self.num_preemptions += 1

    def postprocess(self, seqs: list[Sequence], token_ids: list[int]) -> list[Sequence]:
        """Records the step's sampled tokens, one per sampling sequence in step order (see
        `Sequence.samplers`): a prompt that ends in this step hands its forks their share of its
        blocks. Returns the sequences that got a token, in that order; those that finished are
        out of the queues, with their blocks freed and `finish_reason` set."""
        sampled = iter(token_ids)
        advanced = []
        for seq in seqs:
            seq.num_computed_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            if seq.num_computed_tokens < len(seq.token_ids):
                continue  # a prompt chunk: nothing sampled yet
            seq.token_ids.append(next(sampled))
            advanced.append(seq)
            for fork in seq.forks:  # before `seq` may finish and free its blocks
                self.block_manager.fork(seq, fork)
                self.running.append(fork)
                fork.token_ids.append(next(sampled))
                advanced.append(fork)
                self._check_stop(fork)
            seq.forks = []
            self._check_stop(seq)
        return advanced

    def _check_stop(self, seq: Sequence) -> None:
        params, num_tokens, last = seq.sampling_params, len(seq.token_ids), seq.token_ids[-1]
        num_completion_tokens = num_tokens - seq.num_prompt_tokens
        if last in seq.stop_token_ids and num_completion_tokens >= params.min_tokens:
            self.finish(seq, "stop", last if last in (params.stop_token_ids or ()) else None)
        elif num_tokens >= self.max_model_len or num_completion_tokens == params.max_tokens:
            self.finish(seq, "length")

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """Ends a running sequence: out of the queue, its blocks freed (their hashes stay)."""
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        self.block_manager.deallocate(seq)
        self.running.remove(seq)

    def abort(self, seqs: list[Sequence]) -> None:
        """Drops unfinished sequences wherever they are, and frees their blocks."""
        for seq in seqs:
            if seq in self.waiting:
                self.waiting.remove(seq)
            elif seq in self.running:
                self.running.remove(seq)
            if seq.block_table:
                self.block_manager.deallocate(seq)
