"""The KV-cache pool: fixed-size blocks, ref counts, and a hash-chained prefix cache."""

from collections import OrderedDict

import numpy as np
import xxhash

from nanopaged.core.sequence import PENDING, Sequence, cdiv


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Hash of a full block, chained to the hash of the block before it (of a sequence's
    first block: its `cache_salt`): it names the whole prefix up to this block and what
    computed its K/V (the base model or a LoRA adapter), not only its own tokens."""
    h = xxhash.xxh64()
    if parent_hash is not None:
        h.update(parent_hash.to_bytes(8, "little"))
    h.update(np.array(token_ids, dtype=np.int64).tobytes())
    return h.intdigest()


class BlockManager:
    """Hands out blocks to sequences and keeps the prefix cache.

    Block `b` holds `block_size` token slots; `ref_counts[b]` sequences hold it. A block
    with a hash (`hashes[b]`) holds a full block of tokens (`block_tokens[b]`), computed
    or being computed by the current step, and is shared by every sequence with the same
    prefix and `cache_salt` (where the chain starts: a LoRA adapter's block is never
    served to another adapter, nor to the base model). Plain lists, not an object per
    block: a pool of many thousand blocks is made in a moment. Free blocks wait in
    `free_block_ids`, least recently freed first: that order is the eviction policy. A
    freed block keeps its hash until it is handed out again, for a later request with
    the same prefix. Only full blocks are shared, and never written again. A block's
    hash is entered when the step that fills it is scheduled (later sequences of the
    step may share it: a prompt's n samples; `uncommitted` lists them) and *committed*
    once the step has run: after a failed step, `rollback` forgets it. Nothing is looked
    up without `enable_prefix_caching`, nor for a sequence that asks for its prompt's
    logits. With a `sliding_window` on every layer, a decoding sequence gives back each
    block wholly before the window (its entry becomes -1) but the one the next full
    block's hash chains to: it holds at most window / block_size + 1 blocks."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        sliding_window: int | None = None,
    ):
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.hashes: list[int | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...]] = [()] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        self.free_block_ids = OrderedDict.fromkeys(range(num_blocks))
        # the blocks hashed by the step being scheduled or run
        self.uncommitted: list[int] = []

    @property
    def num_blocks(self) -> int:
        return len(self.ref_counts)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids that already hold the leading full blocks of `seq`, but the block
        of its last token, which the model must run for the next token's logits."""
        hits, parent = [], seq.cache_salt
        if not self.enable_prefix_caching or seq.prompt_logits:
            return hits
        for i in range((len(seq) - 1) // self.block_size):
            token_ids = self._block_tokens(seq, i)
            parent = hash_block(parent, token_ids)
            block_id = self.hash_to_block.get(parent)
            if block_id is None or self.block_tokens[block_id] != token_ids:
                break
            hits.append(block_id)
        return hits

    def allocate(self, seq: Sequence) -> bool:
        """Gives `seq` blocks for all its tokens, reusing cached prefix blocks; returns
        False, changing nothing, when the pool cannot hold them."""
        assert not seq.block_table
        hits = self._cached_prefix(seq)
        hits_in_use = sum(1 for b in hits if self.ref_counts[b] > 0)
        num_blocks = cdiv(len(seq), self.block_size)
        if num_blocks - hits_in_use > len(self.free_block_ids):
            return False
        for block_id in hits:
            if self.ref_counts[block_id] == 0:
                del self.free_block_ids[block_id]
            self.ref_counts[block_id] += 1
        seq.block_table = list(hits)
        for _ in range(num_blocks - len(hits)):
            seq.block_table.append(self._take_free_block())
        seq.num_computed_tokens = len(hits) * self.block_size
        if seq.num_completion_tokens == 0:  # admitted first, not recomputed
            seq.num_cached_tokens = seq.num_computed_tokens
        return True

    def deallocate(self, seq: Sequence) -> None:
        """Releases the blocks of `seq`. Its tail blocks are freed first, so they are
        evicted before the shared head of the prefix."""
        while seq.block_table:
            block_id = seq.block_table.pop()
            if block_id >= 0:  # not given back already (sliding window)
                self._release(block_id)
        seq.num_computed_tokens = 0

    def can_append(self, seq: Sequence) -> bool:
        """Whether the pool can hold the K/V of the token that `seq` decodes next."""
        room = len(seq.block_table) * self.block_size
        return bool(self.free_block_ids) or len(seq.token_ids) <= room

    def may_append(self, seq: Sequence) -> None:
        """Makes room for the K/V of the token that `seq` decodes next: a new block when
        its last one is full; enters the block that token fills in the prefix cache."""
        num_tokens = len(seq.token_ids)
        if num_tokens > len(seq.block_table) * self.block_size:
            seq.block_table.append(self._take_free_block())
        if num_tokens % self.block_size == 0:
            self.cache_block(seq, num_tokens // self.block_size - 1)
        if self.sliding_window:  # the blocks wholly before the window of the token
            before = (num_tokens - self.sliding_window) // self.block_size
            i = min(before, len(seq.block_table) - 2) - 1
            while i >= 0 and seq.block_table[i] >= 0:
                self._release(seq.block_table[i])
                seq.block_table[i] = -1
                i -= 1

    def reserve(self, seq: Sequence, num_slots: int) -> int:
        """After `may_append`: makes room for up to `num_slots` proposals past the last
        token of `seq`, with free blocks only; returns for how many it made room."""
        in_last_block = len(seq.block_table) * self.block_size - len(seq)
        new_blocks = cdiv(num_slots - in_last_block, self.block_size)
        new_blocks = min(new_blocks, self.num_free_blocks)
        for _ in range(new_blocks):
            seq.block_table.append(self._take_free_block())
        return min(num_slots, in_last_block + max(0, new_blocks) * self.block_size)

    def trim(self, seq: Sequence) -> None:
        """After a step that verified proposals of `seq` (the accepted ones and one more
        appended): caches the blocks they filled, gives back those past its end."""
        self.cache_full_blocks(seq, len(seq) - 1 - seq.num_computed_tokens)
        seq.num_computed_tokens = len(seq) - 1
        while len(seq.block_table) > cdiv(len(seq), self.block_size):
            self._release(seq.block_table.pop())

    def cache_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Enters the blocks the next `num_tokens` of `seq` fill in the prefix cache:
        the step writes their K/V before attention reads it, so others may share it."""
        first = seq.num_computed_tokens // self.block_size
        last = (seq.num_computed_tokens + num_tokens) // self.block_size
        for i in range(first, last):
            self.cache_block(seq, i)

    def commit(self, count: int | None = None) -> None:
        """The step ran: the hashes it entered now name K/V that is in the cache. With
        steps launched before the last one finished, the first `count` entered."""
        del self.uncommitted[:count]

    def rollback(self) -> None:
        """The step failed: forget the hashes it entered (their K/V may be missing)."""
        for block_id in self.uncommitted:
            self._forget_hash(block_id)
        self.uncommitted.clear()

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix; refuses (False) while any block is in use."""
        if any(self.ref_counts):
            return False
        for block_id in range(self.num_blocks):
            self._forget_hash(block_id)
        return True

    def reclaim(self) -> None:
        """Frees every block, when no sequence holds any: also those that an allocation
        or a release interrupted halfway (Ctrl-C) left out of the free list."""
        for block_id in range(self.num_blocks):
            self.ref_counts[block_id] = 0
            self.free_block_ids.setdefault(block_id)

    def _block_tokens(self, seq: Sequence, i: int) -> tuple[int, ...]:
        return tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])

    def cache_block(self, seq: Sequence, i: int) -> None:
        """Enters block `i` of `seq`, full, in the prefix cache (unless it is a hit, or
        holds a token not known yet)."""
        block_id, tokens = seq.block_table[i], self._block_tokens(seq, i)
        if self.hashes[block_id] is not None or not self.enable_prefix_caching:  # a hit
            return
        if PENDING in tokens:
            return
        # journalled before the hash exists: no interrupt can leave a hash unjournalled
        self.uncommitted.append(block_id)
        parent = self.hashes[seq.block_table[i - 1]] if i > 0 else seq.cache_salt
        self.block_tokens[block_id] = tokens
        self.hashes[block_id] = hash_block(parent, tokens)
        # of two blocks with one hash (two sequences ran one prefix), the first stays
        self.hash_to_block.setdefault(self.hashes[block_id], block_id)

    def _forget_hash(self, block_id: int) -> None:
        block_hash = self.hashes[block_id]
        if block_hash is not None and self.hash_to_block.get(block_hash) == block_id:
            del self.hash_to_block[block_hash]
        self.hashes[block_id] = None
        self.block_tokens[block_id] = ()

    def _release(self, block_id: int) -> None:
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] == 0:
            self.free_block_ids[block_id] = None

    def _take_free_block(self) -> int:
        block_id, _ = self.free_block_ids.popitem(last=False)
        self._forget_hash(block_id)
        self.ref_counts[block_id] = 1
        return block_id
