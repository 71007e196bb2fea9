"""Batched decoding over a tensor-parallel group: accel.batch's engine on one GPU (TP=1) and over --tp GPUs
(accel.tp.batch: rank 0 drives, every rank runs each step on its shard, the all-reduces inside the captured CUDA
graphs), in the same run, on random bf16 weights at the Llama 3.2 1B/3B shapes.

    decode    B sequences (--batch-sizes) with --context-token random prompts, all prefilled first, then
              WARMUP_STEPS untimed steps (the bucket's CUDA graph captured on every rank), then --decode-steps
              steps each decoding one token of every sequence: B·steps / time of engine.step() as called (schedule,
              the step's inputs broadcast, graph replay, the gathered logits, sampling, the tokens read back).
              --eager: both engines without CUDA graphs.
    --profile ROWS: then, at TP=N, rank 0's host and device over `steps` more steps of the first batch size
              (torch.profiler, CPU and CUDA activity: the ops by self CPU time, where the host waits), and each
              other rank's host over its whole life (prefill and capture included), printed after the table; the
              profiled run's rates are not for citing (the profiler slows the host).
Each rank's shard is drawn on its own GPU (accel.weights.random_weights at the shard's shapes): the same shapes,
bytes and kernels as a loaded checkpoint's shard, without writing one. Method and timing: tools.bench.common.
"""
from __future__ import annotations

import dataclasses
import time

from tools.bench import common

WARMUP_STEPS = 2
BLOCK_SIZE = 16


def shard_weights(cfg, rank: int, world: int, device):
    """Random bf16 weights of rank's shard (accel.tp.shard's shapes: heads, KV heads, hidden units and vocabulary
    rows divided by world) on its GPU; world 1: the whole model."""
    import torch

    from accel.tp.shard import ShardPlan
    from accel.weights import random_weights
    plan = ShardPlan(cfg, rank, world)
    return random_weights(dataclasses.replace(plan.local, vocab_size=plan.vocab_rows), device, torch.bfloat16,
                          seed=rank)


def engine_options(batch: int, context: int, steps: int, eager: bool = False, cuda: bool = True) -> dict:
    """A pool holding `batch` sequences of decode_rate's tokens (sized, not taken from free memory: the same blocks
    at TP=1 and TP=N); on CUDA, graphs and overlapped steps (the engines' defaults), or with `eager` no graphs (the
    steps then overlapped at TP=1, not at TP=N)."""
    per_seq = -(-(context + max_tokens(context, steps)) // BLOCK_SIZE)
    return {"max_num_seqs": batch, "max_num_batched_tokens": 8192, "block_size": BLOCK_SIZE,
            "num_blocks": batch * per_seq + 1,
            **({"cuda_graphs": False} if eager or not cuda else {"cuda_graphs": True, "overlap": True})}


def max_tokens(context: int, steps: int) -> int:
    """Each request's token limit: room for the tokens early requests make while later ones still prefill (fewer
    than `context`), the warm-up and the timed steps, so every sequence decodes through every timed step."""
    return context + WARMUP_STEPS + steps


def prompts(cfg, batch: int, context: int, seed: int = 0) -> list[list[int]]:
    import random
    rng = random.Random(seed * 1000 + batch)
    return [[rng.randrange(cfg.vocab_size) for _ in range(context)] for _ in range(batch)]


def decode_rate(engine, batch_prompts: list[list[int]], steps: int, profile: int = 0) -> dict:
    """All prompts prefilled, WARMUP_STEPS untimed steps, then `steps` timed steps (common.timed_batch_steps) ->
    {"tok_s", "step_ms", "tokens"} (and "profile": `steps` more steps' top `profile` ops); the requests are aborted
    after."""
    ids, made, elapsed, warm_s = common.timed_batch_steps(engine, batch_prompts, WARMUP_STEPS, steps)
    print(f"  B={len(ids)}: prefilled and warmed up (graph captured) in {warm_s:.1f} s", flush=True)
    table = host_profile(lambda: [engine.step() for _ in range(steps)], profile, cuda=True) if profile else None
    common.abort_all(engine, ids)
    if made != steps * len(ids):
        raise RuntimeError(f"{made} tokens in {steps} steps of {len(ids)} sequences: a sequence stopped early")
    return {"tok_s": made / elapsed, "step_ms": 1e3 * elapsed / steps, "tokens": made,
            **({"profile": table} if table else {})}


def host_profile(fn, rows: int, cuda: bool) -> str:
    """fn() under torch.profiler (CPU activity, and CUDA's with `cuda`), synchronised -> the top `rows` ops by
    self CPU time (the host's waits: event synchronisation, gloo receives)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        fn()
        common.sync()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def one_gpu(cfg, batches: list[int], context: int, steps: int, kind: str = "cuda", eager: bool = False) -> dict:
    """kind cpu: the same on the CPU (the tests' tiny model)."""
    import torch

    from accel.batch import BatchEngine
    device = torch.device("cuda", 0) if kind == "cuda" else torch.device("cpu")
    engine = BatchEngine(cfg, shard_weights(cfg, 0, 1, device), device, "bf16", cfg.eos_token_ids,
                         **engine_options(max(batches), context, steps, eager, kind == "cuda"))
    rows = {b: decode_rate(engine, prompts(cfg, b, context), steps) for b in batches}
    del engine
    common.free_gpu()
    return rows


def _follow(group, cfg, options: dict, profile: int = 0) -> None:
    """Ranks 1..N-1: their shard, then rank 0's steps until it closes the engine (under the profiler: its top
    `profile` ops printed)."""
    from accel.tp.batch import batch_engine
    from accel.tp.engine import TPEngine
    shard = TPEngine(group, cfg, shard_weights(cfg, group.rank, group.world, group.device), "bf16")
    if not profile:
        batch_engine(group, shard, **options)
        return
    table = host_profile(lambda: batch_engine(group, shard, **options), profile, cuda=False)
    print(f"rank {group.rank}'s host over its life (prefill, capture and every step):\n{table}", flush=True)


def tensor_parallel(cfg, world: int, batches: list[int], context: int, steps: int, kind: str = "cuda",
                    eager: bool = False, profile: int = 0) -> dict:
    """The same rows over `world` GPUs, this process rank 0 (cuda:0), the others spawned (kind cpu: over gloo);
    profile: the first batch size's steps profiled on every rank (decode_rate, _follow)."""

    from accel.tp.batch import batch_engine
    from accel.tp.engine import TPEngine
    from accel.tp.group import end_group, spawn
    options = engine_options(max(batches), context, steps, eager, kind == "cuda")
    t0 = time.perf_counter()
    group, procs = spawn(world, kind, _follow, (cfg, options, profile))
    print(f"  TP={world}: group of {world} ranks up in {time.perf_counter() - t0:.1f} s", flush=True)
    try:
        shard = TPEngine(group, cfg, shard_weights(cfg, 0, world, group.device), "bf16")
        engine = batch_engine(group, shard, cfg.eos_token_ids, **options)
        try:
            rows = {b: decode_rate(engine, prompts(cfg, b, context), steps, profile if i == 0 else 0)
                    for i, b in enumerate(batches)}
            rows["graphs"] = sorted(engine.runner.graphs.graphs) if engine.runner.graphs else []
        finally:
            engine.close()
    finally:
        end_group(group)
        for p in procs:
            p.join(timeout=60)
    common.free_gpu()
    return rows


def render(rec: dict) -> str:
    n = rec["tp"]
    columns = [("model", "<14"), ("B", ">5"), ("TP=1 tok/s", ">13.0f"), (f"TP={n} tok/s", ">13.0f"),
               ("TP=1 ms", ">9.2f"), (f"TP={n} ms", ">9.2f"), ("speed-up", ">10")]
    rows = [[m["model"], r["batch"], r["tp1"]["tok_s"], r["tpn"]["tok_s"], r["tp1"]["step_ms"], r["tpn"]["step_ms"],
             f"{r['speedup']:.2f}x"] for m in rec["models"] for r in m["rows"]]
    return "\n".join([f"{rec['device']}, {rec['date']}: decode tok/s of the batched engine, {rec['context']}-token "
                      "contexts", *common.table(columns, rows)])


def run(args) -> dict:
    rec = common.record("cuda", tp=args.tp, context=args.context, decode_steps=args.decode_steps,
                        cuda_graphs=not args.eager, profiled=bool(args.profile), models=[])
    for key in args.models:
        cfg = common.model_config(key)
        print(f"TP=1 vs TP={args.tp}, batched decode, {common.MODELS[key]} ...", flush=True)
        tp1 = one_gpu(cfg, args.batch_sizes, args.context, args.decode_steps, eager=args.eager)
        tpn = tensor_parallel(cfg, args.tp, args.batch_sizes, args.context, args.decode_steps, eager=args.eager,
                              profile=args.profile)
        rows = [{"batch": b, "tp1": tp1[b], "tpn": tpn[b], "speedup": tpn[b]["tok_s"] / tp1[b]["tok_s"]}
                for b in args.batch_sizes]
        rec["models"].append({"model": common.MODELS[key], "rows": rows, "graphs": tpn["graphs"]})
        print(render({**rec, "models": rec["models"][-1:]}), flush=True)
        if args.profile:
            b = args.batch_sizes[0]
            print(f"rank 0, {args.decode_steps} steps of B={b}:\n{tpn[b]['profile']}", flush=True)
    common.write_record(args.json_out, rec)
    return rec


def arg_parser():
    ap = common.parser("tools.bench.tp_batch", __doc__, models="3b")
    ap.add_argument("--tp", type=int, default=2, help="GPUs of the tensor-parallel run (default 2)")
    ap.add_argument("--batch-sizes", type=lambda t: [int(b) for b in t.split(",")], default=[64],
                    help="comma-separated (default 64)")
    ap.add_argument("--context", type=int, default=512, help="prompt tokens of each sequence (default 512)")
    ap.add_argument("--decode-steps", type=int, default=32, help="timed decode steps (default 32)")
    ap.add_argument("--eager", action="store_true", help="both engines without CUDA graphs")
    ap.add_argument("--profile", type=int, default=0, metavar="ROWS",
                    help="then profile TP=N's first batch size on every rank (top ROWS ops; rates not for citing)")
    return ap


def main(argv=None):
    ap = arg_parser()
    args = ap.parse_args(argv)
    if args.tp < 2 or args.context < 1 or args.decode_steps < 1 or min(args.batch_sizes) < 1:
        ap.error("--tp must be >= 2; --context, --decode-steps and the batch sizes >= 1")
    common.require_gpus(ap, args.tp, "python3 -m tools.bench.tp_batch")
    return run(args)


if __name__ == "__main__":
    main()
