"""The block pool, its prefix cache and the scheduler, one stated policy at a time (no model)."""
from types import SimpleNamespace

import pytest

from nanopaged import block_manager as bm
from nanopaged.block_manager import BlockManager
from nanopaged.sampling_params import SamplingParams
from nanopaged.scheduler import Scheduler
from nanopaged.sequence import Sequence

BLOCK = 4


def seq_of(tokens: list[int], **params) -> Sequence:
    return Sequence(tokens, SamplingParams(**params), BLOCK)


def admit(manager: BlockManager, seq: Sequence) -> Sequence:
    """Allocate and compute the whole sequence, as a prefill step would."""
    assert manager.can_allocate(seq)
    manager.allocate(seq)
    seq.num_scheduled_tokens = len(seq) - seq.num_computed_tokens
    manager.cache_full_blocks(seq)
    manager.commit()
    seq.num_computed_tokens, seq.num_scheduled_tokens = len(seq), 0
    return seq


def scheduler_of(num_blocks: int = 64, max_num_seqs: int = 8, max_num_batched_tokens: int = 64,
                 scheduling: str = "prefill-first", max_model_len: int = 256) -> Scheduler:
    config = SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                             max_model_len=max_model_len, scheduling=scheduling)
    return Scheduler(config, BlockManager(num_blocks, BLOCK))


def run_step(scheduler: Scheduler, token: int = 7) -> tuple[list[Sequence], bool]:
    """Schedules a step and records `token` for every sequence that samples in it."""
    seqs, is_prefill = scheduler.schedule()
    scheduler.block_manager.commit()
    samplers = [s for seq in seqs if seq.samples_this_step for s in seq.samplers]
    scheduler.postprocess(seqs, [token] * len(samplers))
    return seqs, is_prefill


# ---- the block pool and its prefix cache ----

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


def test_hash_chain_names_the_whole_prefix():
    manager = BlockManager(8, BLOCK)
    admit(manager, seq_of(list(range(10))))
    # the second block's tokens match, but behind a different first block
    b = admit(manager, seq_of([99, 1, 2, 3] + list(range(4, 10))))
    assert b.num_cached_tokens == 0
    assert bm.hash_block(None, [4, 5, 6, 7]) != bm.hash_block(bm.hash_block(None, [0, 1, 2, 3]), [4, 5, 6, 7])


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


def test_stale_hash_of_a_reused_block_no_longer_hits():
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
    manager.commit()
    b = seq_of(list(range(12)))
    manager.allocate(b)
    assert b.num_cached_tokens == 4


def test_rollback_forgets_the_hashes_of_a_step_that_did_not_run():
    manager = BlockManager(8, BLOCK)
    committed = admit(manager, seq_of(list(range(5))))  # block [0..3] committed
    failed = seq_of(list(range(9)))
    manager.allocate(failed)
    failed.num_scheduled_tokens = len(failed) - failed.num_computed_tokens
    manager.cache_full_blocks(failed)  # enters block [4..7]: the step would have written it
    manager.rollback()
    manager.deallocate(failed)
    manager.deallocate(committed)
    again = admit(manager, seq_of(list(range(9))))
    assert again.num_cached_tokens == 4  # the committed block only


def test_eviction_frees_the_tail_first_and_reuses_the_oldest_free_block():
    manager = BlockManager(3, BLOCK)
    a = admit(manager, seq_of(list(range(12))))
    blocks = list(a.block_table)
    manager.deallocate(a)  # free order: the sequence's block 3, then 2, then 1
    assert list(manager.free_block_ids) == blocks[::-1]
    other = admit(manager, seq_of([50, 51]))
    assert other.block_table == [blocks[2]]  # the tail was evicted
    manager.deallocate(other)
    again = admit(manager, seq_of(list(range(9))))
    assert again.num_cached_tokens == 8  # the head of the prefix is still cached


def test_admission_does_not_count_cached_blocks_already_in_use():
    manager = BlockManager(4, BLOCK)
    admit(manager, seq_of(list(range(10))))  # 3 blocks in use, 1 free
    sharer = seq_of(list(range(8)) + [60, 61])  # 3 blocks, the first 2 cached and in use
    assert manager.can_allocate(sharer)
    stranger = seq_of(list(range(100, 106)))  # 2 blocks, none cached
    assert not manager.can_allocate(stranger)


def test_admission_counts_cached_free_blocks_against_the_free_pool():
    manager = BlockManager(3, BLOCK)
    manager.deallocate(admit(manager, seq_of(list(range(12)))))  # 3 cached free blocks
    holder = admit(manager, seq_of([70, 71]))  # evicts the tail: 2 cached blocks left, both free
    seq = seq_of(list(range(12)))  # 3 blocks, 2 hits that are free: needs 3 free blocks
    assert manager.num_free_blocks == 2 and not manager.can_allocate(seq)
    manager.deallocate(holder)
    assert manager.can_allocate(seq)


def test_reclaim_returns_blocks_that_an_interrupt_left_out_of_the_free_list():
    manager = BlockManager(4, BLOCK)
    manager.free_block_ids.popitem(last=False)  # taken, not yet counted (Ctrl-C in between)
    block_id, _ = manager.free_block_ids.popitem(last=False)
    manager.blocks[block_id].ref_count = 1  # counted, but in no block table
    manager.reclaim()
    assert manager.num_free_blocks == 4 and all(b.ref_count == 0 for b in manager.blocks)


def test_append_takes_a_block_only_when_the_last_is_full():
    manager = BlockManager(3, BLOCK)
    seq = admit(manager, seq_of(list(range(4))))
    seq.token_ids.append(4)
    assert manager.can_append(seq)
    manager.may_append(seq)
    assert len(seq.block_table) == 2
    seq.token_ids.append(5)
    manager.may_append(seq)
    assert len(seq.block_table) == 2


def test_can_append_is_false_when_the_pool_is_empty():
    manager = BlockManager(1, BLOCK)
    seq = admit(manager, seq_of(list(range(4))))
    seq.token_ids.append(4)
    assert not manager.can_append(seq)


def test_fork_shares_every_block_and_copies_the_last_on_write():
    manager = BlockManager(8, BLOCK)
    parent = admit(manager, seq_of(list(range(6))))  # blocks [0..3] full, [4, 5] partial
    child = seq_of(list(range(6)))
    manager.fork(parent, child)
    assert child.block_table == parent.block_table
    assert [manager.blocks[b].ref_count for b in parent.block_table] == [2, 2]
    child.token_ids.append(9)
    manager.may_append(child)  # writes into the shared partial block: copy it first
    assert child.block_table[0] == parent.block_table[0]
    assert child.block_table[1] != parent.block_table[1]
    assert manager.block_copies == [(parent.block_table[1], child.block_table[1])]
    parent.token_ids.append(8)
    manager.may_append(parent)  # now the only holder: writes in place
    assert manager.block_copies == [(parent.block_table[1], child.block_table[1])]
    assert [manager.blocks[b].ref_count for b in parent.block_table] == [2, 1]


def test_can_append_into_a_shared_block_needs_a_free_block():
    manager = BlockManager(2, BLOCK)
    parent = admit(manager, seq_of(list(range(6))))
    child = seq_of(list(range(6)))
    manager.fork(parent, child)
    child.token_ids.append(9)
    assert not manager.can_append(child)


def test_deallocate_returns_every_block():
    manager = BlockManager(8, BLOCK)
    seqs = [admit(manager, seq_of(list(range(i, i + 7)))) for i in range(3)]
    for seq in seqs:
        manager.deallocate(seq)
    assert manager.num_free_blocks == 8 and all(b.ref_count == 0 for b in manager.blocks)


# ---- the scheduler ----

def test_prefill_admits_in_order_and_chunks_only_the_last_prompt():
    scheduler = scheduler_of(max_num_batched_tokens=20)
    seqs = [seq_of(list(range(start, start + n))) for start, n in ((0, 8), (100, 9), (200, 10), (300, 3))]
    for seq in seqs:
        scheduler.add(seq)
    scheduled, is_prefill = scheduler.schedule()
    assert is_prefill and scheduled == seqs[:3]
    assert [s.num_scheduled_tokens for s in scheduled] == [8, 9, 3]  # the third is cut
    assert list(scheduler.waiting) == seqs[2:] and list(scheduler.running) == seqs[:2]


def test_each_admitted_sequence_counts_once_against_max_num_seqs():
    scheduler = scheduler_of(max_num_seqs=8)
    for _ in range(8):
        scheduler.add(seq_of([1, 2, 3]))
    scheduled, _ = scheduler.schedule()
    assert len(scheduled) == 8
    scheduler.add(seq_of([1, 2, 3]))
    run_step(scheduler)
    assert scheduler.schedule() == (list(scheduler.running), False)  # the ninth waits


def test_the_samples_of_a_request_count_against_max_num_seqs():
    scheduler = scheduler_of(max_num_seqs=4)
    scheduler.add(seq_of([1, 2]))
    leader = seq_of([3, 4, 5])
    leader.forks = [seq_of([3, 4, 5]) for _ in range(3)]
    scheduler.add(leader)
    scheduled, _ = scheduler.schedule()
    assert scheduled[0].token_ids == [1, 2] and len(scheduled) == 1


def test_forks_share_the_prompt_and_run_after_it_is_prefilled():
    scheduler = scheduler_of()
    leader = seq_of(list(range(6)), n=3)
    leader.forks = [seq_of(list(range(6))) for _ in range(2)]
    forks = list(leader.forks)
    scheduler.add(leader)
    run_step(scheduler)
    assert list(scheduler.running) == [leader, *forks] and leader.forks == []
    assert all(f.block_table == leader.block_table and f.token_ids == leader.token_ids for f in forks)
    seqs, is_prefill = scheduler.schedule()
    assert seqs == [leader, *forks] and not is_prefill
    assert len(scheduler.block_manager.block_copies) == 2  # the partial prompt block, twice


def test_decode_preempts_the_newest_and_puts_it_at_the_front_of_waiting():
    scheduler = scheduler_of(num_blocks=2)
    old, new = seq_of([1, 2, 3, 4]), seq_of([5, 6, 7, 8])
    queued = seq_of([9])
    for seq in (old, new):
        scheduler.add(seq)
    run_step(scheduler)  # each has a full block and a fifth token to decode; the pool is empty
    scheduler.add(queued)
    seqs, is_prefill = scheduler.schedule()  # queued cannot be admitted: a decode step
    assert not is_prefill and seqs == [old]  # new needs a block: preempted
    assert list(scheduler.waiting) == [new, queued] and scheduler.num_preemptions == 1
    assert new.block_table == [] and new.num_computed_tokens == 0


def test_decode_preempts_the_sequence_itself_when_it_is_alone():
    scheduler = scheduler_of(num_blocks=1)
    seq = seq_of([1, 2, 3, 4])
    scheduler.add(seq)
    run_step(scheduler)  # the only block is full; the fifth token needs another
    seqs, _ = scheduler.schedule()
    assert seqs == [] and list(scheduler.waiting) == [seq]


def test_decode_batch_is_capped_by_the_token_budget_oldest_first():
    scheduler = scheduler_of(max_num_batched_tokens=3, max_num_seqs=8)
    seqs = [seq_of([i + 1]) for i in range(5)]
    for seq in seqs:
        scheduler.add(seq)
    while scheduler.waiting:
        run_step(scheduler)
    scheduled, is_prefill = scheduler.schedule()
    assert not is_prefill and scheduled == seqs[:3]


def test_prefill_first_runs_prompts_before_decodes():
    scheduler = scheduler_of()
    first, second = seq_of([1, 2, 3]), seq_of([4, 5, 6])
    scheduler.add(first)
    run_step(scheduler)
    scheduler.add(second)
    scheduled, is_prefill = scheduler.schedule()
    assert scheduled == [second] and is_prefill


def test_mixed_decodes_everyone_and_fills_the_budget_with_prefill_chunks():
    scheduler = scheduler_of(max_num_batched_tokens=10, scheduling="mixed")
    decoding = [seq_of([1, 2]), seq_of([3, 4])]
    for seq in decoding:
        scheduler.add(seq)
    run_step(scheduler)
    long_prompt = seq_of(list(range(30)))
    scheduler.add(long_prompt)
    scheduled, is_prefill = scheduler.schedule()
    assert scheduled == decoding + [long_prompt] and is_prefill
    assert [s.num_scheduled_tokens for s in scheduled] == [1, 1, 8]


@pytest.mark.parametrize("params, tokens, reason, stop_reason", [
    (dict(max_tokens=3), [5, 5, 5], "length", None),
    (dict(max_tokens=9, stop_token_ids=[6]), [5, 6], "stop", 6),
    (dict(max_tokens=9, stop_token_ids=[6], min_tokens=3), [6, 5, 6], "stop", 6),
])
def test_postprocess_finishes_and_frees(params, tokens, reason, stop_reason):
    scheduler = scheduler_of()
    seq = seq_of([1, 2, 3], **params)
    seq.stop_token_ids = frozenset(params.get("stop_token_ids", ()))
    scheduler.add(seq)
    for token in tokens:
        assert seq.finish_reason is None
        run_step(scheduler, token)
    assert (seq.finish_reason, seq.stop_reason) == (reason, stop_reason)
    assert scheduler.is_finished() and scheduler.block_manager.num_free_blocks == 64


def test_length_stops_at_max_model_len():
    scheduler = scheduler_of(max_model_len=6)
    seq = seq_of([1, 2, 3, 4], max_tokens=None)
    scheduler.add(seq)
    run_step(scheduler)
    run_step(scheduler)
    assert seq.finish_reason == "length" and len(seq) == 6


def test_a_preempted_sequence_waits_behind_a_prompt_being_chunked():
    """The chunked prompt holds its blocks: put in front of it, the preempted sequence could never
    be admitted again, nor the prompt continue."""
    scheduler = scheduler_of(num_blocks=4, max_num_batched_tokens=6, scheduling="mixed")
    decoding = seq_of([1, 2, 3])
    scheduler.add(decoding)
    run_step(scheduler)
    prompt = seq_of(list(range(100, 112)))  # 3 blocks, prefilled 5 tokens a step
    scheduler.add(prompt)
    run_step(scheduler)
    assert prompt.num_computed_tokens == 5 and scheduler.block_manager.num_free_blocks == 0
    scheduled, _ = scheduler.schedule()  # `decoding` needs a block: it is preempted
    assert scheduled == [prompt] and list(scheduler.waiting) == [prompt, decoding]
