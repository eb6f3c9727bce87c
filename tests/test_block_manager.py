"""The block pool and its prefix cache, one behaviour at a time."""
from nanopaged import block_manager as bm
from nanopaged.block_manager import BlockManager
from nanopaged.sampling_params import SamplingParams
from nanopaged.sequence import Sequence

BLOCK = 4


def seq_of(tokens: list[int]) -> Sequence:
    return Sequence(tokens, SamplingParams(), BLOCK)


def admit(manager: BlockManager, seq: Sequence) -> Sequence:
    """Allocate and compute the whole sequence, as a prefill step would."""
    assert manager.can_allocate(seq)
    manager.allocate(seq)
    seq.num_scheduled_tokens = len(seq) - seq.num_computed_tokens
    manager.cache_full_blocks(seq)
    seq.num_computed_tokens, seq.num_scheduled_tokens = len(seq), 0
    return seq


def test_allocate_takes_one_block_per_started_block_of_tokens():
    manager = BlockManager(8, BLOCK)
    seq = admit(manager, seq_of(list(range(9))))
    assert len(seq.block_table) == 3 and manager.num_free_blocks == 5
    assert all(manager.blocks[b].ref_count == 1 for b in seq.block_table)


def test_shared_prefix_is_hit_and_ref_counted():
    manager = BlockManager(8, BLOCK)
    a = admit(manager, seq_of(list(range(10))))
    b = admit(manager, seq_of(list(range(8)) + [50, 51, 52]))
    assert b.block_table[:2] == a.block_table[:2] and b.num_cached_tokens == 8
    assert [manager.blocks[x].ref_count for x in a.block_table[:2]] == [2, 2]
    manager.deallocate(a)
    assert [manager.blocks[x].ref_count for x in b.block_table[:2]] == [1, 1]


def test_different_first_block_misses_the_whole_chain():
    manager = BlockManager(8, BLOCK)
    admit(manager, seq_of(list(range(10))))
    b = admit(manager, seq_of([99] + list(range(1, 10))))
    assert b.num_cached_tokens == 0


def test_hash_collision_with_different_tokens_is_a_miss(monkeypatch):
    monkeypatch.setattr(bm, "hash_block", lambda parent, tokens: 42)
    manager = BlockManager(8, BLOCK)
    admit(manager, seq_of([1, 2, 3, 4, 5]))
    b = admit(manager, seq_of([6, 7, 8, 9, 10]))
    assert b.num_cached_tokens == 0


def test_freed_block_is_hit_again():
    manager = BlockManager(8, BLOCK)
    a = admit(manager, seq_of(list(range(9))))
    first_blocks = a.block_table[:2]
    manager.deallocate(a)
    assert manager.num_free_blocks == 8
    b = admit(manager, seq_of(list(range(9))))
    assert b.block_table[:2] == first_blocks and b.num_cached_tokens == 8
    assert manager.num_free_blocks == 5


def test_reused_block_stale_hash_no_longer_hits():
    manager = BlockManager(2, BLOCK)
    manager.deallocate(admit(manager, seq_of(list(range(5)))))
    manager.deallocate(admit(manager, seq_of([90, 91, 92, 93, 94])))  # overwrites both blocks
    c = admit(manager, seq_of(list(range(5))))
    assert c.num_cached_tokens == 0


def test_exact_multiple_prompt_still_computes_its_last_block():
    manager = BlockManager(8, BLOCK)
    admit(manager, seq_of(list(range(8))))
    b = admit(manager, seq_of(list(range(8))))
    assert b.num_cached_tokens == 4


def test_identical_prefixes_scheduled_in_the_same_step_share_blocks():
    manager = BlockManager(8, BLOCK)
    a, b = seq_of(list(range(9))), seq_of(list(range(9)))
    for seq in (a, b):  # both admitted before either is computed, as in one prefill step
        manager.allocate(seq)
        seq.num_scheduled_tokens = len(seq) - seq.num_computed_tokens
        manager.cache_full_blocks(seq)
    assert b.block_table[:2] == a.block_table[:2] and b.num_scheduled_tokens == 1


def test_chunk_registers_only_the_blocks_it_fills():
    manager = BlockManager(8, BLOCK)
    a = seq_of(list(range(12)))
    manager.allocate(a)
    a.num_scheduled_tokens = 6  # first chunk: one full block and half of the next
    manager.cache_full_blocks(a)
    b = seq_of(list(range(12)))
    assert manager.can_allocate(b)
    manager.allocate(b)
    assert b.num_cached_tokens == 4


def test_append_takes_a_block_only_when_the_last_is_full():
    manager = BlockManager(3, BLOCK)
    seq = admit(manager, seq_of(list(range(4))))
    seq.append_token(4)
    assert manager.can_append(seq)
    manager.may_append(seq)
    assert len(seq.block_table) == 2
    seq.append_token(5)
    manager.may_append(seq)
    assert len(seq.block_table) == 2


def test_can_append_is_false_when_the_pool_is_empty():
    manager = BlockManager(1, BLOCK)
    seq = admit(manager, seq_of(list(range(4))))
    seq.append_token(4)
    assert not manager.can_append(seq)


def test_deallocate_returns_every_block():
    manager = BlockManager(8, BLOCK)
    seqs = [admit(manager, seq_of(list(range(i, i + 7)))) for i in range(3)]
    for seq in seqs:
        manager.deallocate(seq)
    assert manager.num_free_blocks == 8 and all(b.ref_count == 0 for b in manager.blocks)
