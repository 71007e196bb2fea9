"""The batch engine's bookkeeping without a model: accel.batch.block_manager (allocation, slots, prefix sharing by
chained hash, reference counts, free) and accel.batch.scheduler (FCFS, chunked prefill under the token budget,
max_num_seqs, preemption by recompute when blocks run out)."""
import pytest

from accel.batch.block_manager import BlockManager, block_hash
from accel.batch.scheduler import Scheduler
from accel.batch.sequence import SamplingParams, Sequence, Status


def seq(tokens, rid="r", max_tokens=16, arrival=0):
    return Sequence(rid, list(tokens), SamplingParams(max_tokens=max_tokens), 0, frozenset(), arrival)


def test_allocation_slots_and_free():
    bm = BlockManager(num_blocks=8, block_size=4)
    s = seq(range(10))
    assert bm.match_prefix(s) == 0  # nothing cached yet
    assert bm.can_append(s, 10)
    bm.may_append(s, 10)
    assert len(s.block_table) == 3 and bm.num_free == 5 and bm.num_used == 3
    assert len(set(s.block_table)) == 3
    assert bm.slot(s, 0) == s.block_table[0] * 4 and bm.slot(s, 9) == s.block_table[2] * 4 + 1
    s.num_computed = 10
    bm.may_append(s, 2)  # positions 10, 11 fit the third block
    assert len(s.block_table) == 3
    bm.may_append(s, 3)  # position 12 starts a fourth
    assert len(s.block_table) == 4
    assert bm.can_append(s, 22) and not bm.can_append(s, 23)  # 10 + 22 tokens: 8 blocks (4 more, 4 free); 33: 9
    bm.free(s)
    assert bm.num_free == 8 and s.block_table == [] and s.num_computed == 0


def test_prefix_sharing_reference_counts_and_eviction():
    bm = BlockManager(num_blocks=6, block_size=4)
    a = seq([1, 2, 3, 4, 5, 6, 7, 8, 9], "a")
    bm.may_append(a, 9)
    a.num_computed = 9
    bm.commit(a)  # two full blocks registered, the third (1 token) not
    assert len(a.block_hashes) == 2
    assert a.block_hashes[1] == block_hash(block_hash(None, [1, 2, 3, 4]), [5, 6, 7, 8])  # chained
    b = seq([1, 2, 3, 4, 5, 6, 7, 8, 50, 51], "b")
    assert bm.match_prefix(b) == 8
    assert b.block_table == a.block_table[:2]
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    c = seq([1, 2, 3, 4, 99, 6, 7, 8, 9], "c")  # the second block differs: only the first is shared
    assert bm.match_prefix(c) == 4 and bm.blocks[a.block_table[0]].ref_count == 3
    d = seq([1, 2, 3, 4], "d")  # the whole prompt cached: its last token is still computed
    assert bm.match_prefix(d) == 0
    for s in (b, c, d):
        bm.free(s)
    bm.free(a)
    assert bm.num_free == 6 and all(blk.ref_count == 0 for blk in bm.blocks)
    e = seq([1, 2, 3, 4, 5, 6, 7, 8, 0], "e")  # freed blocks keep their hash: still shared
    assert bm.match_prefix(e) == 8 and bm.num_free == 4
    bm.free(e)
    hog = seq(range(100, 124), "hog")  # takes every block: the cached ones are overwritten
    bm.may_append(hog, 24)
    assert bm.num_free == 0 and bm.cached == {}
    bm.free(hog)
    f = seq([1, 2, 3, 4, 5, 6, 7, 8, 0], "f")
    assert bm.match_prefix(f) == 0


def test_a_hash_collision_never_shares():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = seq([7, 8, 9], "a")
    bm.may_append(a, 3)
    a.num_computed = 3
    bm.commit(a)
    bm.blocks[a.block_table[0]].token_ids = (0, 0)  # as if another block's tokens had hashed the same
    assert bm.match_prefix(seq([7, 8, 1], "b")) == 0


def make(num_blocks, block_size=4, max_num_seqs=8, budget=64):
    bm = BlockManager(num_blocks, block_size)
    return bm, Scheduler(bm, max_num_seqs, budget)


def run_step(bm, sched, batch, token=5):
    """What the engine does after the model ran: count the tokens computed, append a token where one is sampled."""
    for s in batch:
        sampled = s.samples
        s.seq.num_computed += s.num_tokens
        bm.commit(s.seq)
        if sampled:
            s.seq.append(token)


def test_fcfs_token_budget_and_chunked_prefill():
    bm, sched = make(num_blocks=32, budget=10)
    a, b, c = seq(range(7), "a", arrival=0), seq(range(20, 26), "b", arrival=1), seq([1], "c", arrival=2)
    for s in (a, b, c):
        sched.add(s)
    batch = sched.schedule()
    assert [(s.seq.request_id, s.num_tokens, s.samples) for s in batch] == [("a", 7, True), ("b", 3, False)]
    run_step(bm, sched, batch)
    batch = sched.schedule()  # running first (a decodes, b finishes its prompt), then c is admitted
    assert [(s.seq.request_id, s.num_tokens, s.samples) for s in batch] == [("a", 1, True), ("b", 3, True),
                                                                           ("c", 1, True)]
    assert sched.waiting == type(sched.waiting)() and [s.request_id for s in sched.running] == ["a", "b", "c"]


def test_max_num_seqs():
    bm, sched = make(num_blocks=32, max_num_seqs=2)
    for i in range(3):
        sched.add(seq([i, i], str(i), arrival=i))
    assert [s.seq.request_id for s in sched.schedule()] == ["0", "1"]
    assert [s.request_id for s in sched.waiting] == ["2"]


def test_preemption_frees_the_newest_and_requeues_it_first():
    bm, sched = make(num_blocks=4, block_size=4)
    a, b = seq(range(8), "a", arrival=0), seq(range(10, 16), "b", arrival=1)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()  # a: 2 blocks, b: 2 blocks; the pool is full
    assert [s.num_tokens for s in batch] == [8, 6] and bm.num_free == 0
    run_step(bm, sched, batch)  # a holds 9 tokens (8 computed), b 7 (6 computed)
    batch = sched.schedule()  # a's 9th token needs a third block: b, the newest, is preempted
    assert [(s.seq.request_id, s.num_tokens) for s in batch] == [("a", 1)]
    assert sched.num_preemptions == 1 and b.status is Status.WAITING and b.block_table == [] and b.num_computed == 0
    assert list(sched.waiting) == [b] and b.token_ids == list(range(10, 16)) + [5]  # its tokens are kept
    run_step(bm, sched, batch)
    sched.finish(a)
    batch = sched.schedule()  # b is recomputed from its tokens, prompt and output, after its first block: that one
    # was full and computed, so it kept its hash when freed, and a's growth took b's other block
    assert [(s.seq.request_id, s.num_tokens, s.samples) for s in batch] == [("b", 3, True)]
    assert b.num_computed == 4 and sched.prefix_cached_tokens == 4


def test_a_sequence_that_cannot_grow_preempts_itself_last():
    bm, sched = make(num_blocks=2, block_size=2)
    a = seq([1, 2, 3], "a")
    sched.add(a)
    run_step(bm, sched, sched.schedule())  # 4 tokens, 3 computed: 2 blocks
    a.num_computed = 4
    a.token_ids.append(6)  # a 5th token needs a third block, and nobody else holds one
    assert sched.schedule() == [] and list(sched.waiting) == [a] and bm.num_free == 2


@pytest.mark.parametrize("bad", [dict(max_tokens=0), dict(top_p=0.0), dict(top_k=-1), dict(repetition_penalty=0),
                                 dict(seed=-3)])
def test_sampling_params_refuse_bad_values(bad):
    from refimpl.errors import GenerationError
    with pytest.raises(GenerationError):
        SamplingParams(**bad)


def test_decode_tables_kept_between_steps_equal_tables_built_afresh():
    """The runner's block-table matrix, kept from step to step and written only where a table grew, against the
    tables themselves: through growth, a reorder, a sequence leaving (preempted: its table emptied) and returning,
    and a wider step; never much wider than the widest table asked for."""
    import numpy as np

    from accel.batch.runner import DecodeTables

    def fresh(seqs, width):
        out = np.zeros((len(seqs), width), np.int32)
        for i, s in enumerate(seqs):
            out[i, :len(s.block_table)] = s.block_table
        return out

    bm = BlockManager(num_blocks=200, block_size=2)
    seqs = [seq(range(3 + i), str(i)) for i in range(5)]
    for s in seqs:
        bm.may_append(s, len(s))
    kept = DecodeTables()
    reused, last, widest = [], None, 0
    for step in range(12):
        if step == 4:
            seqs = seqs[::-1]
        if step == 6:
            bm.free(seqs[2])  # preempted: out of the rows, then back with other blocks
            gone = seqs.pop(2)
        if step == 8:
            bm.may_append(gone, len(gone))
            seqs.append(gone)
        for i, s in enumerate(seqs):
            if (step + i) % 3 == 0:
                s.num_computed = len(s.block_table) * 2
                bm.may_append(s, 1 + 2 * (step == 10))  # a new block; at step 10 two
        width = max(len(s.block_table) for s in seqs) + (3 if step == 9 else 0)
        widest = max(widest, width)
        got = kept.of(seqs, width)
        assert got.shape[0] == len(seqs) and width <= got.shape[1] <= widest + DecodeTables.SLACK
        np.testing.assert_array_equal(got[:, :width], fresh(seqs, width), err_msg=f"step {step}")
        reused.append(got is last)  # the same matrix, rows written where they grew
        last = got
    assert reused.count(True) >= 6 and not reused[4] and not reused[6] and not reused[8]
