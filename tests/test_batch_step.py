"""The batch engine's step over a mixed workload (CPU fp32): requests arriving between steps, a tiny pool that forces
preemption, aborts mid-decode, and in the same steps greedy rows (the sampler's no-copy path) beside penalised,
seeded-sampling and logprobs rows (its copying path). Oracle: each request run alone in a fresh engine with room to
spare — the same token ids and finish reason, logprobs within fp32 rounding; an aborted request's tokens a prefix of
its run alone. The incremental outputs must add up to each request's final ones."""
import random

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from accel.batch import BatchEngine, SamplingParams  # noqa: E402
from tests.test_batch_engine import V, build  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build(tmp_path_factory.mktemp("step"), 8, 2, False, seed=3)[1]


def engine(ckpt, **kw):
    return BatchEngine.from_checkpoint(ckpt, device="cpu", dtype="fp32", **{"block_size": 4, **kw})


def workload(seed=0):
    """[(step it arrives at, prompt, params)]: every sampler path, stop ids and lengths, mixed prompt lengths."""
    rng = random.Random(seed)
    shared = [rng.randrange(V) for _ in range(12)]
    kinds = [dict(), dict(logprobs=2), dict(repetition_penalty=1.4), dict(presence_penalty=0.6, frequency_penalty=0.4),
             dict(temperature=0.8, top_k=7, seed=11), dict(temperature=1.1, top_p=0.85, seed=12, logprobs=0),
             dict(), dict(stop_token_ids=tuple(range(0, V, 4))), dict(logprobs=3, presence_penalty=0.3)]
    jobs = []
    for i, kind in enumerate(kinds * 2):
        prompt = (shared if i % 3 == 0 else []) + [rng.randrange(V) for _ in range(rng.randrange(2, 26))]
        params = SamplingParams(max_tokens=rng.randrange(4, 16), ignore_eos=i % 4 != 0, **kind)
        jobs.append((i // 3, prompt, params))
    return jobs


ABORTS = {6: "3", 12: "5", 30: "12"}  # step -> the request aborted before it


def run_mixed(eng, jobs):
    """Steps the engine, adding each job at its step and aborting per ABORTS -> (final output per request id,
    the tokens each request's step outputs added up to)."""
    finals, seen, step = {}, {}, 0
    while step <= max(a for a, _, _ in jobs) or eng.has_unfinished():
        for i, (arrive, prompt, params) in enumerate(jobs):
            if arrive == step:
                eng.add_request(prompt, params, request_id=str(i))
        if step in ABORTS:
            eng.abort(ABORTS[step])
        for out in eng.step():
            seen[out.request_id] = seen.get(out.request_id, []) + out.new_token_ids
            assert out.token_ids == seen[out.request_id], out.request_id
            if out.finished:
                finals[out.request_id] = out
        step += 1
    return finals, seen


@pytest.mark.parametrize("overlap", [False, True])
def test_mixed_workload_equals_each_request_alone(ckpt, overlap):
    """overlap: each step launched before the previous one's tokens are read back (the engine's mode on CUDA): its
    decode rows' input ids taken on the device, stop tokens learned a step late and the extra token dropped."""
    jobs = workload()
    eng = engine(ckpt, num_blocks=22, max_num_seqs=8, max_num_batched_tokens=24, overlap=overlap)
    finals, seen = run_mixed(eng, jobs)
    stats = eng.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cached_tokens"] > 0  # the workload does what it says
    assert stats["blocks_used"] == 0 and not eng.seqs
    assert sorted(finals, key=int) == [str(i) for i in range(len(jobs))]
    reasons = {out.finish_reason for out in finals.values()}
    assert {"stop", "length", "abort"} <= reasons
    for rid, out in finals.items():
        _, prompt, params = jobs[int(rid)]
        want = engine(ckpt, overlap=False).generate([prompt], params)[0]
        assert seen[rid] == out.token_ids
        assert out.num_prompt_tokens == len(prompt)
        if out.finish_reason == "abort":
            assert rid in ABORTS.values()
            assert out.token_ids == want.token_ids[:len(out.token_ids)], rid
            continue
        assert (out.token_ids, out.finish_reason) == (want.token_ids, want.finish_reason), rid
        if params.logprobs is None:
            assert out.logprobs is None
            continue
        assert len(out.logprobs) == len(out.token_ids)
        for (tid, lp, top), (w_tid, w_lp, w_top) in zip(out.logprobs, want.logprobs):
            assert tid == w_tid and [i for i, _ in top] == [i for i, _ in w_top]
            assert lp == pytest.approx(w_lp, abs=1e-5)  # fp32 GEMMs of other row counts round differently
            assert [v for _, v in top] == pytest.approx([v for _, v in w_top], abs=1e-5)
    assert any(out.finish_reason == "abort" and out.token_ids for out in finals.values())  # one aborted mid-decode


def test_mixed_workload_is_reproducible(ckpt):
    """The same workload twice gives the same bits: nothing in a step depends on leftovers of an earlier one."""
    jobs = workload(seed=1)
    a, _ = run_mixed(engine(ckpt, num_blocks=22, max_num_seqs=8, max_num_batched_tokens=24), jobs)
    b, _ = run_mixed(engine(ckpt, num_blocks=22, max_num_seqs=8, max_num_batched_tokens=24), jobs)
    assert {r: (o.token_ids, o.finish_reason, o.logprobs) for r, o in a.items()} == \
        {r: (o.token_ids, o.finish_reason, o.logprobs) for r, o in b.items()}
