"""The block manager's policies, at unit level: what the prefix cache keeps and finds,
and what a sliding-window sequence gives back."""

import pytest

from nanopaged.core.block_manager import BlockManager, hash_block
from nanopaged.core.sequence import SamplingOptions, Sequence
from nanopaged.serving.router import prefix_hashes

BLOCK = 4


def sequence(tokens: list[int]) -> Sequence:
    return Sequence(tokens, SamplingOptions(max_tokens=None))


def admitted(manager: BlockManager, tokens: list[int]) -> Sequence:
    """A sequence given its blocks and scheduled whole, its full blocks cached,
    committed."""
    seq = sequence(tokens)
    assert manager.allocate(seq)
    manager.cache_full_blocks(seq, len(seq) - seq.num_computed_tokens)
    seq.num_computed_tokens = len(seq)
    manager.commit()
    return seq


@pytest.mark.parametrize("salt", [None, 12345])
def test_prefix_hashes_are_the_names_the_cache_gives_the_blocks(salt):
    """What the server's router predicts of a replica's cache: each full block's hash,
    chained from the sequence's salt (a LoRA adapter's), as the cache enters it."""
    manager = BlockManager(8, BLOCK)
    seq = sequence(list(range(11)))
    seq.cache_salt = salt
    assert manager.allocate(seq)
    manager.cache_full_blocks(seq, len(seq))
    manager.commit()
    cached = [manager.hashes[block_id] for block_id in seq.block_table[:2]]
    assert prefix_hashes(seq.token_ids, BLOCK, salt) == cached
    assert prefix_hashes(seq.token_ids, BLOCK) != prefix_hashes(seq.token_ids, BLOCK, 1)


def test_reset_prefix_cache_refuses_while_any_block_is_in_use():
    manager = BlockManager(8, BLOCK)
    seq = admitted(manager, list(range(9)))
    assert manager.hash_to_block
    assert manager.reset_prefix_cache() is False
    assert len(manager.hash_to_block) == 2  # nothing forgotten
    manager.deallocate(seq)
    assert manager.reset_prefix_cache() is True
    assert not manager.hash_to_block and all(h is None for h in manager.hashes)


def test_the_first_copy_of_a_block_stays_found():
    """Two sequences that computed the same prefix side by side hold two copies; the
    cache finds the first, also after the second is freed."""
    manager = BlockManager(8, BLOCK)
    first, second = sequence(list(range(6))), sequence(list(range(6)))
    assert manager.allocate(first) and manager.allocate(second)  # neither cached yet
    for seq in (first, second):
        manager.cache_full_blocks(seq, 6)
    manager.commit()
    assert first.block_table[0] != second.block_table[0]
    assert (
        manager.hash_to_block[manager.hashes[first.block_table[0]]]
        == first.block_table[0]
    )
    manager.deallocate(second)
    third = sequence(list(range(6)))
    assert manager.allocate(third) and third.block_table[0] == first.block_table[0]
    assert third.num_cached_tokens == BLOCK


def test_num_cached_tokens_counts_the_first_admission_not_a_recompute():
    manager = BlockManager(8, BLOCK)
    earlier = admitted(manager, list(range(9)))  # its blocks 0..3, 4..7 are cached
    seq = sequence(list(range(10)))
    assert manager.allocate(seq) and seq.num_cached_tokens == 8
    seq.num_computed_tokens = len(seq)
    seq.token_ids += [70, 71]  # completion tokens, then a preemption
    manager.deallocate(seq)
    manager.deallocate(earlier)
    assert manager.reset_prefix_cache()  # nothing to find when it comes back
    # recomputed from scratch
    assert manager.allocate(seq) and seq.num_computed_tokens == 0
    assert seq.num_cached_tokens == 8


@pytest.mark.parametrize("window", [2, 6])
def test_a_sliding_window_sequence_gives_back_the_blocks_before_its_window(window):
    """Blocks of 4: while it decodes, each block wholly before the window of the token
    it runs is given back (-1), but the one before its last, even when the window has
    left it (window 2): the next full block's hash chains to its hash. At most window /
    4 + 2 are held."""
    manager = BlockManager(16, BLOCK, sliding_window=window)
    seq = admitted(manager, list(range(5)))
    for token in range(5, 40):
        seq.token_ids.append(token)
        manager.may_append(seq)
        seq.num_computed_tokens += 1
        held = [b for b in seq.block_table if b >= 0]
        # the block of the first key the token sees
        first_needed = (len(seq) - window) // BLOCK
        assert all(b >= 0 for b in seq.block_table[first_needed:])
        assert seq.block_table[-2] >= 0
        assert seq.block_table[: first_needed - 1].count(-1) == max(0, first_needed - 1)
        assert len(held) <= window // BLOCK + 2
        assert manager.num_free_blocks == 16 - len(held)
        # its last block is full now: cached, chained to the one before
        if len(seq) % BLOCK == 0:
            before_last, last = seq.block_table[-2:]
            assert manager.hashes[last] == hash_block(
                manager.hashes[before_last], tuple(seq.token_ids[-BLOCK:])
            )


def test_without_a_window_no_block_is_given_back():
    manager = BlockManager(16, BLOCK)
    seq = admitted(manager, list(range(5)))
    for token in range(5, 30):
        seq.token_ids.append(token)
        manager.may_append(seq)
    assert all(b >= 0 for b in seq.block_table) and len(seq.block_table) == 8
