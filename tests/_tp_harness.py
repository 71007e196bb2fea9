"""Runs tensor-parallel jobs in N spawned processes, for tests/test_tp.py (CPU, gloo) and tests/test_tp_gpu.py (one
GPU a rank, NCCL): one group serves every case of a job (starting processes costs seconds). Each rank writes what it
saw to <out>/rank<r>.json. `run_ranks` is the spawning for any rank function (tests/_tp_batch_harness.py's too)."""
from __future__ import annotations

import json
import os
import traceback
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from accel.tp.engine import TPEngine
from accel.tp.group import end_group, free_port, init
from accel.tp.launch import engine_class
from refimpl.formats.safetensors_io import SafetensorsFile
from refimpl.generate import Sampling
from refimpl.quant.schemes import QuantSpec


class Recorder(TPEngine):
    """A following rank that keeps every [token, go on] message rank 0 broadcasts, and every rank the order of its
    broadcasts and session allocations (on the GPU a session's capture runs the decode step's collectives, so every
    rank must allocate at the same point of the message sequence)."""

    followed: list
    order: list

    def _broadcast(self, values, n):
        t = super()._broadcast(values, n)
        self.order.append(f"broadcast {n}")
        if n == 2:
            self.followed.append(t.tolist())
        return t

    def alloc_cache(self, capacity, image_tokens=0):
        self.order.append(f"alloc {capacity}")
        return super().alloc_cache(capacity, image_tokens)


def _shapes(engine: TPEngine) -> dict:
    w, lw = engine.weights, engine.weights.layers[0]
    return {"embed": list(w.embed.shape), "lm_head": list(w.lm_head.shape), "tied": w.lm_head is w.embed,
            "qkv": list(lw.qkv.shape), "o": list(lw.o.shape), "gate_up": list(lw.gate_up.shape),
            "down": list(lw.down.shape)}


def _case(group, case: dict) -> dict:
    whole = []  # tensors read whole (SafetensorsFile.load), not as a slice
    original = SafetensorsFile.load
    SafetensorsFile.load = lambda self, name: whole.append(name) or original(self, name)
    try:
        engine = Recorder.load(group, Path(case["dir"]), case.get("dtype", "fp32"),
                               QuantSpec.parse(case["quant"]) if case.get("quant") else None)
    finally:
        SafetensorsFile.load = original
    engine.followed, engine.order = [], []
    out = {"shapes": _shapes(engine), "whole": whole, "logits": [], "eager": [], "tokens": []}
    for step in case.get("steps", []):  # golden-style: every rank runs the same forward in lockstep
        if step["start"] == 0:
            cache = engine.alloc_cache(case["capacity"])
        ids = torch.tensor(step["ids"], device=engine.device)
        out["logits"].append(engine.forward(ids, step["start"], cache)[0].float().tolist())
        if len(ids) == 1:  # the fused decode step ran: the eager forward of the same token (its k/v rewritten)
            out["eager"].append(engine.prefill(ids, step["start"], cache)[0].float().tolist())
    if group.rank == 0:
        for r in case.get("requests", []):
            s = Sampling(max_new_tokens=r["max_new"], temperature=r.get("temperature", 0.0), seed=r.get("seed"),
                         top_k=r.get("top_k", 0))
            out["tokens"].append(list(engine.generate(r["prompt"], s, stop_ids=r.get("stop", ()))))
        engine.close()
    else:
        engine.serve()
    out["followed"], out["order"] = engine.followed, engine.order
    return out


def _vision_case(group, case: dict) -> dict:
    """A Llama 3.2 Vision checkpoint (accel.tp.vision_engine): the images of case["images"] (an .npz of
    pixel_values, aspect_ratio_ids, aspect_ratio_mask, cross_attention_mask) encoded on every rank, or none, then
    the prompt and each step's ids in lockstep -> the gathered logits of each step; of each decoded token (the
    fused decode step) also the eager forward's logits of the same token (its k/v rewritten)."""
    from accel.tp.vision_engine import TPVisionEngine
    from refimpl.vision.inputs import ImageInputs
    engine = TPVisionEngine.load(group, Path(case["dir"]), case.get("dtype", "fp32"),
                                  QuantSpec.parse(case["quant"]) if case.get("quant") else None)
    steps, out = case["steps"], {"logits": [], "eager": []}
    images = None
    if group.rank == 0 and case.get("images"):
        with np.load(case["images"], allow_pickle=False) as f:
            images = ImageInputs(*(f[k] for k in ("pixel_values", "aspect_ratio_ids", "aspect_ratio_mask",
                                                  "cross_attention_mask")))
    if case.get("images"):
        sess = engine.image_request(images, len(steps[0]), case["capacity"])
    else:
        sess = engine.alloc_cache(case["capacity"])
    start = 0
    for ids in steps:
        t = torch.tensor(ids, device=engine.device)
        out["logits"].append(engine.forward(t, start, sess)[0].float().tolist())
        if len(ids) == 1 and start > 0:
            out["eager"].append(engine.prefill(t, start, sess)[0].float().tolist())
        start += len(ids)
    return out


def _status_kib(field: str) -> int:
    """VmRSS (resident now) or VmHWM (its high-water mark) of this process, in KiB. Not ru_maxrss: a spawned
    child's counts the parent's memory at the fork."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _peak(group, case: dict) -> dict:
    """Host memory of loading one shard (a text or a Vision checkpoint): resident before, the high-water mark
    after, in KiB; the bytes of the shard's tensors (their storages, each once)."""
    before = _status_kib("VmRSS")
    engine = engine_class(Path(case["dir"])).load(group, Path(case["dir"]), "fp32")
    peak = _status_kib("VmHWM")
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in _tensors(engine)}
    return {"before_kib": before, "peak_kib": peak, "shard_bytes": sum(storages.values())}


def _tensors(engine):
    w = engine.weights
    yield from (w.embed, w.lm_head, w.norm)
    for lw in w.layers:
        yield from (lw.attn_norm, lw.qkv, lw.o, lw.mlp_norm, lw.gate_up, lw.down)
    vision = getattr(engine, "vision_weights", None)
    if vision is not None:
        for cl, kv in zip(vision.cross, vision.image_kv):
            yield from (*vars(cl).values(), *kv)
        yield from vision.vision.values()


def _fail(group, case: dict) -> dict:
    """Rank case["rank"] fails to load its shard: what each rank raises (none may hang)."""
    import accel.tp.engine as engine_module
    from refimpl.errors import CheckpointError

    def broken(*args):
        raise CheckpointError("a broken shard")
    if group.rank == case["rank"]:
        engine_module.load_shard = broken
    try:
        TPEngine.load(group, Path(case["dir"]), "fp32")
    except Exception as e:  # noqa: BLE001  what each rank raised is the result
        return {"raised": type(e).__name__, "message": str(e)}
    return {"raised": None}


def _cases(group, job: dict) -> dict:
    if job["kind"] in ("peak", "fail"):
        return {"peak": _peak, "fail": _fail}[job["kind"]](group, job["case"])
    case = _vision_case if job["kind"] == "vision" else _case
    return {name: case(group, c) for name, c in job["cases"].items()}


def _rank(rank: int, world: int, port: int, work, job: dict, out: str) -> None:
    """One spawned rank: its group, then work(group, job) -> what it writes to <out>/rank<r>.json (or the trace of
    what it raised). `work` may close the group itself, to go on alone."""
    torch.set_num_threads(1)
    try:
        device = torch.device("cuda", rank) if job.get("device") == "cuda" else torch.device("cpu")
        group = init(rank, world, device, "127.0.0.1", port)
        result = work(group, job)
        if dist.is_initialized():
            end_group(group)
    except Exception:  # noqa: BLE001  reported to the test
        result = {"error": traceback.format_exc()}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def run_ranks(work, job: dict, out: Path, world: int = 2, timeout: float = 600) -> list[dict]:
    """work(group, job) on `world` spawned ranks (work: a module-level function, so spawn can name it) -> each
    rank's result (a rank's exception fails here, with its trace)."""
    port = free_port()
    ctx = mp.get_context("spawn")
    env = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        procs = [ctx.Process(target=_rank, args=(r, world, port, work, job, str(out))) for r in range(world)]
        for p in procs:
            p.start()
    finally:
        if env is None:
            os.environ.pop("OMP_NUM_THREADS")
        else:
            os.environ["OMP_NUM_THREADS"] = env
    for p in procs:
        p.join(timeout)
    if any(p.is_alive() for p in procs):
        for p in procs:
            p.kill()
        raise AssertionError(f"the ranks of a {job.get('kind', 'batch')} job did not finish in {timeout} s")
    missing = [r for r in range(world) if not Path(out, f"rank{r}.json").exists()]
    assert not missing, f"rank {missing[0]} wrote no result (exit code {procs[missing[0]].exitcode})"
    results = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]
    for r, res in enumerate(results):
        assert "error" not in res, f"rank {r}:\n{res['error']}"
    return results


def run_job(job: dict, out: Path, world: int = 2, timeout: float = 600) -> list[dict]:
    """Run `job` (its kind: text cases, vision cases, peak or fail) on `world` spawned ranks -> each rank's result."""
    return run_ranks(_cases, job, out, world, timeout)
