"""The KV-cache pool: fixed-size blocks, ref counts, and a hash-chained prefix cache."""
from collections import OrderedDict

import numpy as np
import xxhash

from nanopaged.sequence import Sequence


def hash_block(parent_hash: int | None, token_ids: list[int]) -> int:
    """Hash of a full block, chained to the hash of the block before it.

    Chaining makes the hash name the whole prefix up to this block, not only its own tokens.
    """
    h = xxhash.xxh64()
    if parent_hash is not None:
        h.update(parent_hash.to_bytes(8, "little"))
    h.update(np.array(token_ids, dtype=np.int64).tobytes())
    return h.intdigest()


class Block:
    """One block of `block_size` token slots. A block with a hash holds a full, computed
    block of tokens and can be shared by every sequence with the same prefix."""

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: list[int] = []


class BlockManager:
    """Hands out blocks to sequences and keeps the prefix cache.

    Free blocks wait in `free_block_ids`, least recently freed first: that order is the eviction
    policy. A freed block keeps its hash, so a later request with the same prefix can take it
    back, until the block is handed out again and its contents overwritten.
    """

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block: dict[int, int] = {}
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids that already hold the leading full blocks of `seq`.

        Only blocks before the one holding the last token are looked up, so at least one token
        is always left to compute: the model needs it to produce the next token's logits.
        """
        hits, parent = [], None
        for i in range((len(seq) - 1) // self.block_size):
            token_ids = seq.block_tokens(i)
            parent = hash_block(parent, token_ids)
            block_id = self.hash_to_block.get(parent)
            if block_id is None or self.blocks[block_id].token_ids != token_ids:
                break
            hits.append(block_id)
        return hits

    def can_allocate(self, seq: Sequence) -> bool:
        hits = self._cached_prefix(seq)
        hits_in_use = sum(1 for b in hits if self.blocks[b].ref_count > 0)
        return seq.num_blocks - hits_in_use <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> None:
        """Give `seq` blocks for all its tokens, reusing cached prefix blocks. Call only after
        `can_allocate(seq)` returned True."""
        assert not seq.block_table
        hits = self._cached_prefix(seq)
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_block_ids[block_id]
            block.ref_count += 1
        seq.block_table = hits + [self._take_free_block() for _ in range(seq.num_blocks - len(hits))]
        seq.num_computed_tokens = len(hits) * self.block_size
        if seq.num_completion_tokens == 0:  # first admission, not a recompute after preemption
            seq.num_cached_tokens = seq.num_computed_tokens

    def deallocate(self, seq: Sequence) -> None:
        """Release the blocks of `seq`. Its tail blocks are freed first, so they are evicted
        before the shared head of the prefix."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
        seq.block_table = []
        seq.num_computed_tokens = 0

    def can_append(self, seq: Sequence) -> bool:
        """Whether the pool can hold the K/V of the token that `seq` decodes next."""
        fits = len(seq.token_ids) <= len(seq.block_table) * self.block_size
        return fits or len(self.free_block_ids) > 0

    def may_append(self, seq: Sequence) -> None:
        """Makes room for the K/V of the token that `seq` decodes next (a new block when its
        last one is full); when that token fills its block, enters the block in the prefix cache."""
        num_tokens = len(seq.token_ids)
        if num_tokens > len(seq.block_table) * self.block_size:
            seq.block_table.append(self._take_free_block())
        if num_tokens % self.block_size == 0:
            self._cache_block(seq, num_tokens // self.block_size - 1)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Enter in the prefix cache the blocks that this step's tokens fill.

        Called when the step is scheduled: the step writes their K/V in every layer before any
        attention reads it, so a sequence scheduled later in the same step may share them.
        """
        first = seq.num_computed_tokens // self.block_size
        last = (seq.num_computed_tokens + seq.num_scheduled_tokens) // self.block_size
        for i in range(first, last):
            self._cache_block(seq, i)

    def _cache_block(self, seq: Sequence, i: int) -> None:
        block = self.blocks[seq.block_table[i]]
        if block.hash is not None:  # a cache hit: already registered
            return
        parent = self.blocks[seq.block_table[i - 1]].hash if i > 0 else None
        block.token_ids = seq.block_tokens(i)
        block.hash = hash_block(parent, block.token_ids)
        self.hash_to_block[block.hash] = block.block_id

    def _take_free_block(self) -> int:
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:
            if self.hash_to_block.get(block.hash) == block_id:
                del self.hash_to_block[block.hash]
            block.hash, block.token_ids = None, []
        block.ref_count = 1
        return block_id
