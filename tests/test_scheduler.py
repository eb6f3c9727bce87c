"""The block pool, its prefix cache and the scheduler, one stated policy at a time. The
scheduler's steps run through the engine's own step, with a stand-in for the model."""

import pytest
from conftest import ScriptedRunner

from nanopaged import LLM, SamplingParams
from nanopaged.core import block_manager as bm
from nanopaged.core.block_manager import BlockManager
from nanopaged.core.sequence import Sequence

BLOCK = 4


def seq_of(tokens: list[int], **params) -> Sequence:
    return Sequence(tokens, SamplingParams(**params))


def admit(manager: BlockManager, seq: Sequence) -> Sequence:
    """Allocate and compute the whole sequence, as a prefill step would."""
    assert manager.allocate(seq)
    manager.cache_full_blocks(seq, len(seq) - seq.num_computed_tokens)
    manager.commit()
    seq.num_computed_tokens = len(seq)
    return seq


# ---- the block pool and its prefix cache ----


def test_allocate_takes_one_block_per_started_block_of_tokens():
    manager = BlockManager(8, BLOCK)
    seq = admit(manager, seq_of(list(range(9))))
    assert len(seq.block_table) == 3 and manager.num_free_blocks == 5
    assert all(manager.ref_counts[b] == 1 for b in seq.block_table)


def test_shared_prefix_is_hit_and_ref_counted():
    manager = BlockManager(8, BLOCK)
    a = admit(manager, seq_of(list(range(10))))
    b = admit(manager, seq_of(list(range(8)) + [50, 51, 52]))
    assert b.block_table[:2] == a.block_table[:2] and b.num_cached_tokens == 8
    assert [manager.ref_counts[x] for x in a.block_table[:2]] == [2, 2]
    manager.deallocate(a)
    assert [manager.ref_counts[x] for x in b.block_table[:2]] == [1, 1]


def test_hash_chain_names_the_whole_prefix():
    manager = BlockManager(8, BLOCK)
    admit(manager, seq_of(list(range(10))))
    # the second block's tokens match, but behind a different first block
    b = admit(manager, seq_of([99, 1, 2, 3] + list(range(4, 10))))
    assert b.num_cached_tokens == 0
    assert bm.hash_block(None, [4, 5, 6, 7]) != bm.hash_block(
        bm.hash_block(None, [0, 1, 2, 3]), [4, 5, 6, 7]
    )


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
    # overwrites both blocks
    manager.deallocate(admit(manager, seq_of([90, 91, 92, 93, 94])))
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
    # both admitted before either is computed, as in one prefill step
    for seq in (a, b):
        manager.allocate(seq)
        manager.cache_full_blocks(seq, len(seq) - seq.num_computed_tokens)
    assert b.block_table[:2] == a.block_table[:2] and b.num_computed_tokens == 8


def test_chunk_registers_only_the_blocks_it_fills():
    manager = BlockManager(8, BLOCK)
    a = seq_of(list(range(12)))
    manager.allocate(a)
    manager.cache_full_blocks(a, 6)  # first chunk: one full block and half of the next
    manager.commit()
    b = seq_of(list(range(12)))
    manager.allocate(b)
    assert b.num_cached_tokens == 4


def test_rollback_forgets_the_hashes_of_a_step_that_did_not_run():
    manager = BlockManager(8, BLOCK)
    committed = admit(manager, seq_of(list(range(5))))  # block [0..3] committed
    failed = seq_of(list(range(9)))
    manager.allocate(failed)
    # enters block [4..7], as its step would
    manager.cache_full_blocks(failed, len(failed))
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
    stranger = seq_of(list(range(100, 106)))  # 2 blocks, none cached
    assert not manager.allocate(stranger) and not stranger.block_table
    # 3 blocks, the first 2 cached and in use
    sharer = seq_of(list(range(8)) + [60, 61])
    assert manager.allocate(sharer) and manager.num_free_blocks == 0


def test_admission_counts_cached_free_blocks_against_the_free_pool():
    manager = BlockManager(3, BLOCK)
    manager.deallocate(admit(manager, seq_of(list(range(12)))))  # 3 cached free blocks
    # evicts the tail: 2 cached blocks left, both free
    holder = admit(manager, seq_of([70, 71]))
    seq = seq_of(list(range(12)))  # 3 blocks, 2 hits that are free: needs 3 free blocks
    assert manager.num_free_blocks == 2 and not manager.allocate(seq)
    assert sorted(manager.ref_counts) == [0, 0, 1]  # nothing changed
    manager.deallocate(holder)
    assert manager.allocate(seq) and seq.num_computed_tokens == 8


def test_reclaim_returns_blocks_that_an_interrupt_left_out_of_the_free_list():
    manager = BlockManager(4, BLOCK)
    # taken, not yet counted (Ctrl-C in between)
    manager.free_block_ids.popitem(last=False)
    block_id, _ = manager.free_block_ids.popitem(last=False)
    manager.ref_counts[block_id] = 1  # counted, but in no block table
    manager.reclaim()
    assert manager.num_free_blocks == 4 and not any(manager.ref_counts)


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


def test_a_shared_full_block_is_never_written_a_new_token_takes_a_new_block():
    manager = BlockManager(8, BLOCK)
    a = admit(manager, seq_of(list(range(9))))
    b = admit(manager, seq_of(list(range(8)) + [70]))  # shares a's two full blocks
    b.token_ids.append(71)
    manager.may_append(b)
    assert (
        b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    )
    assert [manager.ref_counts[x] for x in b.block_table] == [2, 2, 1]


def test_deallocate_returns_every_block():
    manager = BlockManager(8, BLOCK)
    seqs = [admit(manager, seq_of(list(range(i, i + 7)))) for i in range(3)]
    for seq in seqs:
        manager.deallocate(seq)
    assert manager.num_free_blocks == 8 and not any(manager.ref_counts)


# ---- the scheduler, through the engine's step ----


@pytest.fixture
def engine(qwen3_path):
    """engine(**options) -> an LLM whose steps run a ScriptedRunner, with BLOCK-token
    blocks."""

    def make(
        num_blocks=64,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        scheduling="prefill-first",
        max_model_len=256,
    ) -> LLM:
        llm = LLM(
            qwen3_path,
            kvcache_block_size=BLOCK,
            num_kvcache_blocks=num_blocks,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            scheduling=scheduling,
            max_model_len=max_model_len,
        )
        llm.engine.runner = ScriptedRunner()
        return llm

    return make


def add(llm: LLM, tokens: list[int], max_tokens: int = 8, **params) -> Sequence:
    """Queues a request; returns its first sequence."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params)
    return llm.requests[llm.add_request(tokens, params)].seqs[0]


def last_step(llm: LLM) -> list[tuple[Sequence, int]]:
    """(sequence, tokens it ran) for each sequence of the step that ran last."""
    step = llm.engine.runner.steps[-1]
    return list(zip(step.seqs, step.num_tokens))


def test_prefill_admits_in_order_and_chunks_only_the_last_prompt(engine):
    llm = engine(max_num_batched_tokens=20)
    seqs = [
        add(llm, list(range(s, s + n)))
        for s, n in ((10, 8), (100, 9), (200, 10), (300, 3))
    ]
    llm.step()
    # the third is cut
    assert last_step(llm) == [(seqs[0], 8), (seqs[1], 9), (seqs[2], 3)]
    scheduler = llm.engine.scheduler
    assert list(scheduler.waiting) == seqs[2:] and list(scheduler.running) == seqs[:2]
    # a cut prompt samples nothing yet
    assert llm.engine.runner.steps[-1].sampling_seqs == seqs[:2]


def test_a_chunk_never_cuts_one_of_the_prompts_spans(engine):
    """A chunk that would end inside one of the sequence's `spans` ends at its start,
    or runs on to its end (past the budget) when it would run none of the chunk
    before it."""
    llm = engine(max_num_batched_tokens=8)
    seq = add(llm, list(range(1, 31)))
    seq.spans = [(5, 17), (20, 22)]
    chunks = []
    while seq.num_computed_tokens < 30:
        llm.step()
        chunks.append(last_step(llm)[0][1])
    assert chunks == [5, 12, 8, 5]


def test_each_admitted_sequence_counts_once_against_max_num_seqs(engine):
    llm = engine(max_num_seqs=8)
    seqs = [add(llm, [1, 2, 3]) for _ in range(9)]
    llm.step()
    assert [seq for seq, _ in last_step(llm)] == seqs[:8]
    llm.step()
    # a decode step: the ninth waits
    assert [seq for seq, _ in last_step(llm)] == seqs[:8]
    assert list(llm.engine.scheduler.waiting) == seqs[8:]


def samples(llm: LLM, seq: Sequence) -> list[Sequence]:
    """The sequences of the request `seq` belongs to."""
    return llm.owners[seq][0].seqs


def test_each_sample_of_a_request_counts_once_against_max_num_seqs(engine):
    llm = engine(max_num_seqs=4)
    first = add(llm, [1, 2])
    second = samples(llm, add(llm, [3, 4, 5], n=4))
    llm.step()
    assert last_step(llm) == [(first, 2), *((s, 3) for s in second[:3])]
    assert list(llm.engine.scheduler.waiting) == second[3:]


def test_the_samples_of_a_prompt_share_its_full_blocks_through_the_prefix_cache(engine):
    """A request's n samples are n sequences; those admitted after the first find its
    full blocks entered in the prefix cache (in the same step), and compute only the
    rest."""
    llm = engine()
    # one full block, 2 tokens
    leader, *others = samples(llm, add(llm, list(range(6)), n=3))
    llm.step()
    step = llm.engine.runner.steps[-1]
    assert last_step(llm) == [(leader, 6), (others[0], 2), (others[1], 2)]
    assert step.sampling_seqs == [leader, *others] and step.sampling_indices == [
        0,
        1,
        2,
    ]
    assert all(
        s.block_table[0] == leader.block_table[0] and s.num_cached_tokens == 4
        for s in others
    )
    # the partial block: private
    assert len({s.block_table[1] for s in (leader, *others)}) == 3
    llm.step()
    assert last_step(llm) == [(leader, 1), (others[0], 1), (others[1], 1)]


def test_decode_preempts_the_newest_and_puts_it_at_the_front_of_waiting(engine):
    llm = engine(num_blocks=4)
    # its sampled token needs a second block
    oldest = add(llm, [1, 2, 3, 4], max_tokens=2)
    middle, newer, newest = (add(llm, [t, t + 1], max_tokens=2) for t in (10, 20, 30))
    llm.step()  # the pool is full: one block each
    queued = add(llm, [40], max_tokens=2)
    llm.step()  # `oldest` needs a block: the newest running sequence gives up its own
    assert last_step(llm) == [(oldest, 1), (middle, 1), (newer, 1)]
    scheduler = llm.engine.scheduler
    assert (
        list(scheduler.waiting) == [newest, queued] and scheduler.num_preemptions == 1
    )
    assert newest.block_table == [] and newest.num_computed_tokens == 0


def test_a_preempted_sequence_is_recomputed_with_its_tokens(engine):
    llm = engine(num_blocks=3)
    add(llm, [1, 2, 3, 4], max_tokens=6)
    second = add(llm, [5, 6, 7], max_tokens=6)
    llm.step()
    llm.step()  # `first` takes the last block
    llm.step()  # `second` needs a block: it is the newest, so it gives up its own
    assert list(llm.engine.scheduler.waiting) == [second] and len(second) == 5
    while second not in llm.engine.runner.steps[-1].seqs:
        llm.step()
    # its prompt and its sampled tokens, recomputed
    assert last_step(llm) == [(second, 5)]


def test_decode_preempts_the_sequence_itself_when_no_other_runs(engine):
    llm = engine(num_blocks=4, max_num_batched_tokens=6)
    alone = add(llm, [1, 2, 3, 4], max_tokens=4)  # its next token needs a second block
    llm.step()
    prompt = add(llm, list(range(100, 112)), max_tokens=4)  # 3 blocks, 6 tokens a step
    llm.step()  # the prompt's first chunk takes the rest of the pool
    # a decode step between chunks: `alone` needs a block and gives up its own; with
    # nothing left to decode, the prompt's next chunk runs instead
    llm.step()
    assert last_step(llm) == [(prompt, 6)] and list(llm.engine.scheduler.waiting) == [
        alone
    ]
    assert alone.block_table == [] and llm.engine.scheduler.num_preemptions == 1


def test_decode_batch_is_capped_by_the_token_budget_oldest_first(engine):
    llm = engine(max_num_batched_tokens=3)
    seqs = [add(llm, [i + 1]) for i in range(5)]
    while llm.engine.scheduler.waiting:
        llm.step()
    llm.step()
    assert [seq for seq, _ in last_step(llm)] == seqs[:3]


def test_prefill_first_runs_prompts_before_decodes(engine):
    llm = engine()
    add(llm, [1, 2, 3])
    llm.step()
    second = add(llm, [4, 5, 6])
    llm.step()
    assert last_step(llm) == [(second, 3)]


def test_prefill_first_decodes_between_two_chunks_of_a_prompt(engine):
    llm = engine(max_num_batched_tokens=8)
    add(llm, [1, 2], max_tokens=20)
    llm.step()
    prompt = add(llm, list(range(10, 30)))
    kinds = []
    for _ in range(6):
        llm.step()
        kinds.append([(seq is prompt, n) for seq, n in last_step(llm)])
    assert kinds == [
        [(True, 8)],
        [(False, 1)],
        [(True, 8)],
        [(False, 1)],
        [(True, 4)],
        [(False, 1), (True, 1)],
    ]


def test_mixed_decodes_everyone_and_fills_the_budget_with_prefill_chunks(engine):
    llm = engine(max_num_batched_tokens=10, scheduling="mixed")
    decoding = [add(llm, [1, 2]), add(llm, [3, 4])]
    llm.step()
    long_prompt = add(llm, list(range(30)))
    llm.step()
    assert last_step(llm) == [(decoding[0], 1), (decoding[1], 1), (long_prompt, 8)]
    assert llm.engine.runner.steps[-1].ragged


def test_a_step_is_a_plain_decode_only_when_each_sequence_runs_its_last_token_once(
    engine,
):
    llm = engine(max_num_batched_tokens=3, scheduling="mixed")
    add(llm, [1, 2]), add(llm, [3, 4])
    llm.step()
    llm.step()
    assert not llm.engine.runner.steps[-1].ragged  # two decodes
    prompt = add(llm, [5, 6])
    kinds = []
    for _ in range(2):  # two decodes and one prompt token a step
        llm.step()
        step = llm.engine.runner.steps[-1]
        kinds.append((last_step(llm)[-1], len(step.sampling_seqs), step.ragged))
    # a token inside the prompt (ragged), then its last token: every sequence runs its
    # last token once, a plain decode step
    assert kinds == [((prompt, 1), 2, True), ((prompt, 1), 3, False)]


def test_a_preempted_sequence_waits_behind_a_prompt_being_chunked(engine):
    """The chunked prompt holds its blocks: put in front of it, the preempted sequence
    could never be admitted again, nor the prompt continue."""
    llm = engine(num_blocks=4, max_num_batched_tokens=6, scheduling="mixed")
    decoding = add(llm, [1, 2, 3], max_tokens=4)
    llm.step()
    prompt = add(llm, list(range(100, 112)), max_tokens=4)  # 3 blocks, 5 tokens a step
    llm.step()
    assert (
        prompt.num_computed_tokens == 5
        and llm.engine.block_manager.num_free_blocks == 0
    )
    llm.step()  # `decoding` needs a block: it is preempted
    assert last_step(llm) == [(prompt, 6)]
    assert list(llm.engine.scheduler.waiting) == [prompt, decoding]


@pytest.mark.parametrize(
    "params, tokens, reason, stop_reason",
    [
        (dict(max_tokens=3), [5, 5, 5], "length", None),
        (dict(max_tokens=9, stop_token_ids=[6]), [5, 6], "stop", 6),
        (
            dict(max_tokens=2, stop_token_ids=[6]),
            [5, 6],
            "stop",
            6,
        ),  # a stop token beats max_tokens
    ],
)
def test_a_step_finishes_and_frees(engine, params, tokens, reason, stop_reason):
    llm = engine()
    seq = add(llm, [1, 2, 3], **params)
    for token in tokens:
        assert seq.finish_reason is None
        llm.engine.runner.token = token
        [output] = llm.step()
    completion = output.outputs[0]
    assert (completion.finish_reason, completion.stop_reason) == (reason, stop_reason)
    assert llm.is_finished() and llm.engine.block_manager.num_free_blocks == 64


def test_length_stops_at_max_model_len(engine):
    llm = engine(max_model_len=6)
    seq = add(llm, [1, 2, 3, 4], max_tokens=None)
    llm.step()
    llm.step()
    assert seq.finish_reason == "length" and len(seq) == 6
