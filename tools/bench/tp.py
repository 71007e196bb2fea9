"""Tensor-parallel decoding (accel.tp) at the Llama 3.2 1B/3B shapes on random bf16 weights: TP=1 (the one-GPU
engine, accel.engine.AccelEngine) against TP=N in the same run.

    decode     batch 1: a 32-token prompt, then --new-tokens greedy tokens, one CUDA graph replay a token (on every
               rank the same argmax of the same gathered logits: no token is broadcast, no host sync); CUDA events
               on rank 0 time the replays after a warm-up run (graph capture), median of --reps.
               Roofline: the weight bytes a token reads (the whole model's, accel.weights.Weights.nbytes_per_token)
               over the measured copy bandwidth of the GPUs it runs on (each rank measures its own).
    allreduce  one all-reduce of the residual stream [1, D] as the decode step runs it: captured in a CUDA graph
               with 2·L others (L layers), replayed; µs each.
    shard      rank 0's shard (its heads, hidden units, vocabulary rows) decoding alone on one GPU through the
               one-GPU engine, no collectives: a TP=N token's compute, apart from its all-reduces and waits.
Ranks are processes: this one is rank 0 and spawns ranks 1..N-1 (accel.tp.group.spawn), which run the same
measurements. Other rows (batch 64, the vision models) are other leaves' records.
Method and timing: tools.bench.common.
"""
from __future__ import annotations

import dataclasses

from tools.bench import common

PROMPT = 32


def shard_weights(cfg, plan, device, seed: int):
    """Random bf16 weights of one rank's shard: its local config's shapes, ceil(V/N) vocabulary rows."""
    import torch

    from accel.weights import random_weights
    return random_weights(dataclasses.replace(plan.local, vocab_size=plan.vocab_rows), device, torch.bfloat16, seed)


def tp_row(group, key: str, new_tokens: int, reps: int, copy: float) -> dict:
    """Every rank: batch-1 decode of one model over the group -> its row (rank 0's timings)."""
    import torch

    from accel.tp.engine import TPEngine
    from accel.tp.model import RankSplit
    from accel.tp.shard import ShardPlan
    cfg, dev = common.model_config(key), group.device
    plan = ShardPlan(cfg, group.rank, group.world)
    engine = TPEngine(group, cfg, shard_weights(cfg, plan, dev, seed=1 + group.rank), "bf16")
    sess = engine.session(PROMPT + new_tokens)
    prompt = torch.tensor(common.prompt_ids(cfg, PROMPT), device=dev)
    ms, _ = common.timed_greedy(engine, sess, lambda: engine.forward(prompt, 0, sess), PROMPT, new_tokens, reps)
    split = RankSplit(group.rank, group.world, 0, 0)
    row = {"model": common.MODELS[key], "tp": group.world, "batch": 1, "new_tokens": new_tokens,
           "decode_tok_s": (new_tokens - 1) / (ms * 1e-3),
           "copy_tb_s_all_gpus": copy, "allreduce_us": common.allreduce_us(split, cfg.hidden_size, cfg.num_hidden_layers, dev)}
    if group.is_root:
        print(f"  {row['model']} TP={group.world}: {row['decode_tok_s']:.1f} tok/s, all-reduce "
              f"{row['allreduce_us']:.1f} us (copy {copy:.2f} TB/s over the ranks)", flush=True)
    return row


def tp_rows(group, keys: list[str], new_tokens: int, reps: int, copy: float) -> list[dict]:
    import torch
    rows = []
    for key in keys:
        rows.append(tp_row(group, key, new_tokens, reps, copy))
        torch.cuda.empty_cache()  # the model's engine and weights are gone with tp_row's frame
    return rows


def group_rows(group, keys: list[str], new_tokens: int, reps: int) -> list[dict]:
    """Every rank: the GPUs' copy bandwidth summed (what the weights stream at, all ranks together), then the
    rows."""
    import torch
    import torch.distributed as dist
    copy = torch.tensor([common.copy_bandwidth(group.device)], dtype=torch.float64, device=group.device)
    dist.all_reduce(copy)
    return tp_rows(group, keys, new_tokens, reps, float(copy))


def _serve_rank(group, keys, new_tokens, reps) -> None:
    """A spawned rank's part: the same measurements in step with rank 0 (its numbers are rank 0's to report)."""
    group_rows(group, keys, new_tokens, reps)


def tp1_row(key: str, device, new_tokens: int, copy_tb_s: float, shard_of: int = 1) -> dict:
    """The one-GPU engine's batch-1 decode on the same shapes (its own random weights). shard_of N: on rank 0's
    shard of a --tp N split instead (its heads, hidden units and vocabulary rows), alone on one GPU: what a rank
    computes a token without the collectives."""
    import torch

    from accel.engine import AccelEngine
    from accel.tp.shard import ShardPlan
    from accel.weights import random_weights
    cfg = common.model_config(key)
    if shard_of > 1:
        plan = ShardPlan(cfg, 0, shard_of)
        cfg = dataclasses.replace(plan.local, vocab_size=plan.vocab_rows)
    weights = random_weights(cfg, device, torch.bfloat16, seed=0)
    rate, _, _ = common.decode_rate(AccelEngine(cfg, weights, torch.device(device), "bf16"), PROMPT, new_tokens)
    row = {"model": common.MODELS[key], "tp": 1, "batch": 1, "new_tokens": new_tokens, "decode_tok_s": rate,
           "copy_tb_s_all_gpus": copy_tb_s, "bytes_per_token_gb": weights.nbytes_per_token() / 1e9,
           "shard_of": shard_of}
    del weights
    torch.cuda.empty_cache()
    return row


def run(args, command: str | None = None) -> dict:
    import torch

    from accel.tp.group import end_group, spawn
    rec = common.record("cuda:0", command=command, tp=args.tp, decode=[])
    copy = common.copy_bandwidth("cuda:0")
    one = {}
    for k in args.models:
        one[k] = tp1_row(k, "cuda:0", args.new_tokens, copy)
        print(f"  {one[k]['model']} TP=1: {one[k]['decode_tok_s']:.1f} tok/s ({one[k]['bytes_per_token_gb']:.3f} GB "
              f"a token, copy {copy:.2f} TB/s)", flush=True)
    alone = {k: tp1_row(k, "cuda:0", args.new_tokens, copy, shard_of=args.tp) for k in args.models}
    print(f"TP=1 and a shard alone measured; starting {args.tp} ranks ...", flush=True)
    group, procs = spawn(args.tp, "cuda", _serve_rank, (args.models, args.new_tokens, args.reps))
    try:
        tp = group_rows(group, args.models, args.new_tokens, args.reps)
    finally:
        end_group(group)
        for p in procs:
            p.join(timeout=60)
    rec["decode"] = [one[k] for k in args.models]
    rec["shard_alone"] = [alone[k] for k in args.models]
    for row in tp:
        base = one[next(k for k in args.models if common.MODELS[k] == row["model"])]
        row["bytes_per_token_gb"] = base["bytes_per_token_gb"]
        row["speedup_vs_tp1"] = row["decode_tok_s"] / base["decode_tok_s"]
        row["shard_alone_ms"] = 1e3 / alone[next(k for k in args.models if common.MODELS[k] == row["model"])][
            "decode_tok_s"]
        for r in (base, row):
            r["roofline_tok_s"] = r["copy_tb_s_all_gpus"] * 1e12 / (r["bytes_per_token_gb"] * 1e9)
            r["roofline_pct"] = 100 * r["decode_tok_s"] / r["roofline_tok_s"]
        rec["decode"].append(row)
    torch.cuda.synchronize()
    print(render(rec), flush=True)
    common.write_record(args.json_out, rec)
    return rec


def render(rec: dict) -> str:
    columns = [("model", "<14"), ("TP", ">4"), ("batch", ">6"), ("tok/s", ">9.1f"), ("x TP=1", ">8.2f"),
               ("roofline", ">10.1f"), ("% roof", ">8.1f"), ("all-reduce us", ">15.1f"), ("ms", ">7.3f"),
               ("shard alone ms", ">16.3f")]
    rows = [[r["model"], r["tp"], r["batch"], r["decode_tok_s"], r.get("speedup_vs_tp1", "-"), r["roofline_tok_s"],
             r["roofline_pct"], r.get("allreduce_us", "-"), 1e3 / r["decode_tok_s"], r.get("shard_alone_ms", "-")]
            for r in rec["decode"]]
    return "\n".join([f"tensor-parallel decode — {rec['device']} x{rec['tp']} — {rec['date']}",
                      *common.table(columns, rows),
                      f"(batch 1: a {PROMPT}-token prompt, then greedy tokens, one CUDA graph replay a token; "
                      "roofline: the whole model's weight bytes a token over the copy bandwidth of the GPUs used; "
                      "all-reduce: one [1, D] bf16 all-reduce inside a CUDA graph; ms: a token; shard alone: rank "
                      "0's shard decoding on one GPU without collectives, what a TP=N token costs before them)"])


def arg_parser():
    ap = common.parser("tools.bench.tp", __doc__, models="1b,3b")
    ap.add_argument("--tp", type=int, default=2, help="ranks, one GPU each (default 2)")
    ap.add_argument("--new-tokens", type=int, default=256, help="greedy tokens decoded (default 256)")
    ap.add_argument("--reps", type=int, default=3, help="timed runs after the warm-up one (default 3)")
    return ap


def main(argv=None):
    ap = arg_parser()
    args = ap.parse_args(argv)
    if args.tp < 2 or args.new_tokens < 2 or args.reps < 1:
        ap.error("--tp and --new-tokens must be >= 2, --reps >= 1")
    common.require_gpus(ap, args.tp, "python3 -m tools.bench.tp")
    return run(args)


if __name__ == "__main__":
    main()
