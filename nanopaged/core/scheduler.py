"""Decides what the next step runs: its sequences, their tokens, which rows sample."""

from collections import deque

from nanopaged.core.block_manager import BlockManager
from nanopaged.core.config import Config
from nanopaged.core.sequence import Sequence
from nanopaged.core.step import ScheduledStep


class Scheduler:
    """Two queues: `waiting` (not yet prefilled, or preempted) and `running` (decoding).

    Prefill admits waiting sequences in order while the token budget
    (`max_num_batched_tokens`), `max_num_seqs` and free blocks allow; only a step's last
    prompt can overflow the budget, and is then prefilled in chunks over several steps
    (without `enable_chunked_prefill`, it waits for a step with room for all of it); a
    chunk never cuts one of the sequence's `spans` (`uncut`).
    Decode gives each running sequence one token, oldest first, up to the budget; when
    the pool has no block for one, the newest running sequence is preempted: its blocks
    are freed, to be recomputed later (its prefix often still cached), and it goes back
    to the front of `waiting` (behind a prompt being prefilled in chunks).

    `prefill-first` runs a prefill step whenever a prompt can be admitted, else a decode
    step, but decodes between two chunks of a prompt: a long prompt stalls the running
    sequences for one step of `max_num_batched_tokens` tokens at a time. `mixed` (as
    vLLM V1, Sarathi-Serve) decodes every running sequence in each step and spends the
    rest of the budget on prefill chunks. A step is booked at once:
    `num_computed_tokens` counts the tokens it computes."""

    def __init__(self, config: Config, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0
        self.decode_next = False  # prefill-first: a prompt chunk ran, decodes go next

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def schedule(self) -> ScheduledStep:
        """The next step (with no sequences when there is nothing to run), booked."""
        step, budget = ScheduledStep(), self.config.max_num_batched_tokens
        if self.config.scheduling == "mixed":
            self._schedule_decode(step)  # one token a sequence
            self._schedule_prefill(step, budget - len(step.seqs))
            return step
        if not (self.decode_next and self.running):
            self._schedule_prefill(step, budget)
        if not step.seqs:
            self._schedule_decode(step)
        if not step.seqs:  # every running sequence was preempted
            self._schedule_prefill(step, budget)
        last = step.seqs[-1] if step.seqs else None
        self.decode_next = last is not None and last.num_computed_tokens < len(last)
        return step

    def _schedule_prefill(self, step: ScheduledStep, budget: int) -> None:
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            chunked = self.config.enable_chunked_prefill
            if not chunked and len(seq) - seq.num_computed_tokens > budget:
                break  # it waits for a step with room for all of it
            full = len(self.running) >= self.config.max_num_seqs
            # no room (a partly prefilled sequence holds its blocks already)
            if not seq.block_table and (full or not self.block_manager.allocate(seq)):
                break
            num_tokens = min(len(seq) - seq.num_computed_tokens, budget)
            if seq.spans:
                num_tokens = uncut(seq, num_tokens)
            self.block_manager.cache_full_blocks(seq, num_tokens)
            step.add(seq, num_tokens)
            seq.num_computed_tokens += num_tokens
            budget -= num_tokens
            if seq.num_computed_tokens < len(seq):
                break  # the rest of its prompt is prefilled in the next steps
            self.running.append(self.waiting.popleft())

    def _schedule_decode(self, step: ScheduledStep) -> None:
        scheduled: list[Sequence] = []
        while self.running and len(scheduled) < self.config.max_num_batched_tokens:
            seq = self.running.popleft()
            if self._make_room(seq, step):
                self.block_manager.may_append(seq)
                seq.num_computed_tokens += 1
                scheduled.append(seq)
        self.running.extendleft(reversed(scheduled))
        step.add_decodes(scheduled)

    def _make_room(self, seq: Sequence, step: ScheduledStep) -> bool:
        """Preempts the newest running sequences until `seq` can append a token;
        preempts `seq` itself (and returns False) when it is the only one left."""
        while not self.block_manager.can_append(seq):
            victim = self.running.pop() if self.running else seq
            step.preempted.append(victim)
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.deallocate(seq)
        # first in line, but behind a prompt prefilled in chunks (it holds its blocks)
        chunked = bool(self.waiting) and bool(self.waiting[0].block_table)
        self.waiting.insert(1 if chunked else 0, seq)
        self.num_preemptions += 1

    def preempt_all(self) -> None:
        """Preempts every running sequence, newest first, as when the pool runs out (a
        feature that is about to drop the KV cache: sleep mode)."""
        while self.running:
            self._preempt(self.running.pop())

    def finish(self, seqs: list[Sequence], reason: str) -> None:
        """Ends unfinished sequences wherever they are and frees their blocks (their
        hashes stay): `reason` is "stop", "length" or "abort"."""
        for seq in seqs:
            if seq.finish_reason is not None:
                continue
            if seq in self.running:
                self.running.remove(seq)
            elif seq in self.waiting:
                self.waiting.remove(seq)
            self.block_manager.deallocate(seq)
            seq.finish_reason = reason


def uncut(seq: Sequence, num_tokens: int) -> int:
    """A chunk of `num_tokens` from where `seq`'s prefill stands, moved off any of its
    `spans` it would cut: back to the span's start, or on past its end (over the budget)
    when it would run none of the chunk before it."""
    start = seq.num_computed_tokens
    end = start + num_tokens
    for first, last in seq.spans:
        if first < end < last:
            return first - start if first > start else last - start
    return num_tokens
