"""Runs the batched engine over a tensor-parallel group in N spawned processes, for tests/test_tp_batch_gpu.py (one
GPU a rank, NCCL) and tests/test_tp_batch.py (the CPU, gloo): rank 0 runs the requests through the TP engine
recording each step's logits, closes the group, then runs them through the one-device engine
(accel.batch.BatchEngine on its own device) and writes both to <out>/rank0.json with the worst logits NMSE while
their tokens agree."""
from __future__ import annotations

import gc
from pathlib import Path

import torch

from accel.batch import BatchEngine, SamplingParams
from accel.tp.batch import batch_engine
from accel.tp.engine import TPEngine
from accel.tp.group import end_group
from refimpl.formats.checkpoint import load_checkpoint
from tests._batch_runs import nmse, run_recording
from tests._tp_harness import run_ranks


def _requests(job: dict) -> list:
    params = SamplingParams(max_tokens=job["max_tokens"], ignore_eos=True)
    return [(p, params, {}) for p in job["prompts"]]


def worst_nmse(tokens, logits, ref_tokens, ref_logits) -> tuple[float, int]:
    """The worst NMSE of a request's step logits against the reference's, over the steps before their tokens first
    differ (a bf16 near-tie going the other way changes what later steps see) -> (worst, steps compared)."""
    worst, compared = 0.0, 0
    for toks, rows, ref_toks, ref_rows in zip(tokens, logits, ref_tokens, ref_logits):
        for step, (a, b) in enumerate(zip(rows, ref_rows)):
            if toks[:step] != ref_toks[:step]:
                break
            worst, compared = max(worst, nmse(a, b)), compared + 1
    return worst, compared


def _compare(group, job: dict) -> dict:
    """Rank 0: the requests through the TP engine, the group closed, then through the one-device engine -> both and
    their worst NMSE; the other ranks follow rank 0's steps -> {}."""
    result = {}
    engine = batch_engine(group, TPEngine.load(group, Path(job["dir"]), job["dtype"]), **job["options"])
    if group.rank == 0:
        tokens, logits = run_recording(engine, _requests(job))
        graphs = engine.runner.graphs  # not kept past close: the group's end waits until every graph is freed
        result["graphs"] = [list(k) for k in graphs.graphs] if graphs is not None else []
        del graphs
        engine.close()
    end_group(group)
    if group.rank == 0:
        del engine
        gc.collect()
        if group.device.type == "cuda":
            torch.cuda.empty_cache()
        ref = BatchEngine.from_checkpoint(load_checkpoint(job["dir"], with_tokenizer=False),
                                          device=str(group.device), dtype=job["dtype"], **job["options"])
        ref_tokens, ref_logits = run_recording(ref, _requests(job))
        worst, compared = worst_nmse(tokens, logits, ref_tokens, ref_logits)
        result.update(tokens=tokens, ref_tokens=ref_tokens, worst_nmse=worst, steps_compared=compared)
        if job.get("return_logits"):  # small vocabularies only: [requests][steps][V]
            result.update(logits=[[r.tolist() for r in rows] for rows in logits],
                          ref_logits=[[r.tolist() for r in rows] for rows in ref_logits])
    return result


def run_job(job: dict, out: Path, world: int = 2, timeout: float = 600) -> dict:
    """`job` on `world` spawned ranks -> rank 0's result (a rank's exception fails here, with its trace)."""
    return run_ranks(_compare, job, out, world, timeout)[0]
