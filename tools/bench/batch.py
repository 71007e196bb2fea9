"""Batched decoding: accel.batch.BatchEngine at the Llama 3.2 1B/3B shapes on random bf16 weights, against the
roofline and against HF transformers' continuous batching (`generate_batch`, paged SDPA) on the same requests.

    decode    B = 1, 8, 32, 64, 128, 256 sequences with --context-token prompts, all prefilled first, then
              WARMUP_STEPS untimed steps (the batch size's graph captured); then --decode-steps steps each
              decoding one token of every sequence: B·steps / time of engine.step() as called (schedule, inputs,
              graph replay, sampling, the tokens read back). "replay": the same step's CUDA graph replayed alone
              (the device's share). "invariant": the same steps on an engine in batch-invariant mode (its cost;
              --skip-invariant to skip). --eager: the same steps on an engine without CUDA graphs.
              Roofline: the bytes a step must read (the weights once, and each sequence's K/V at its
              length) over the measured copy bandwidth. HF: generate_batch of the same prompts for 1 and for
              1 + steps new tokens, the difference. --profile-batch B: the top kernels of B's graph replay.
    workload  --requests requests from a fixed seed, prompt lengths uniform in [32, 1024] and outputs in
              [32, 512] (eos ignored: every request makes its full count): total time and output tok/s, ours and HF's
              (its ContinuousBatchingManager, each request its own max_new_tokens) on the first --hf-requests of
              them (ours timed on those too: the speedup compares the same requests).
    HF        its CUDA graphs on and its KV cache at HF_MEMORY of the free memory (--hf-cuda-graphs auto:
              transformers' defaults), the rest sized by transformers as generate_batch sizes it; how HF is
              driven: tools/bench/common/hf.py.
Method and timing: tools.bench.common (records: command, device, date, versions).
"""
from __future__ import annotations

import argparse
import random
import time

from tools.bench import common

BATCH_SIZES = (1, 8, 32, 64, 128, 256)
HF_REQUESTS = 200  # HF runs the first 200 of the workload: all 1000 take it minutes a model (docs/performance.md)
WARMUP_STEPS = 2  # untimed decode steps before the timed ones (graph capture, Triton compiles)


def batch_sizes(text: str) -> list[int]:
    """'1,8,32' -> [1, 8, 32]; anything else is an argparse error (one line, exit 2)."""
    try:
        sizes = [int(b) for b in text.split(",") if b.strip()]
    except ValueError:
        sizes = []
    if not sizes or any(b < 1 for b in sizes):
        raise argparse.ArgumentTypeError(f"--batch-sizes {text}: expected positive integers separated by commas")
    return sizes


def workload(n: int, seed: int = 0, vocab: int = 128000, prompt=(32, 1024), output=(32, 512)):
    """n requests: (prompt ids, output tokens), lengths uniform in the closed ranges, the same for a seed."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = rng.randint(*prompt)
        out.append(([rng.randrange(vocab) for _ in range(p)], rng.randint(*output)))
    return out


def decode_prompts(cfg, batch: int, context: int, seed: int = 0) -> list[list[int]]:
    """`batch` random prompts of `context` tokens, the same for (batch, seed): ours and HF's decode the same."""
    rng = random.Random(seed * 1000 + batch)
    return [[rng.randrange(cfg.vocab_size) for _ in range(context)] for _ in range(batch)]


def kv_bytes(cfg, tokens: int, element_size: int = 2) -> int:
    """K and V of `tokens` positions over every layer."""
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * tokens * element_size


def roofline_tok_s(weight_bytes: int, cfg, batch: int, context: float, copy_tb_s: float) -> float:
    """Tokens a second if a decode step of `batch` sequences of mean length `context` took only the time to read
    its bytes (the weights once, every sequence's K/V) at the copy bandwidth."""
    step_bytes = weight_bytes + batch * kv_bytes(cfg, int(context))
    return batch * copy_tb_s * 1e12 / step_bytes


# ---- ours ----

def new_engine(cfg, weights, device, max_num_seqs: int, **options):
    import torch

    from accel.batch import BatchEngine
    return BatchEngine(cfg, weights, torch.device(device), "bf16", max_num_seqs=max_num_seqs, **options)


def engine_options(args) -> dict:
    """The BatchEngine options every engine of a run shares (--block-size)."""
    size = getattr(args, "block_size", None)
    return {} if size is None else {"block_size": size}


def run_until_done(engine, ids: list[str]) -> int:
    """Steps until every request in `ids` finished -> the tokens they generated."""
    left, tokens = set(ids), 0
    while left and engine.has_unfinished():
        for out in engine.step():
            tokens += len(out.new_token_ids) if out.request_id in left else 0
            if out.finished:
                left.discard(out.request_id)
    return tokens


def decode_rate(engine, prompts: list[list[int]], steps: int, profile: bool = False) -> dict:
    """All prompts prefilled (each has its first token), WARMUP_STEPS untimed steps, then `steps` timed steps
    decoding every sequence -> {"tok_s", "tokens" made in the timed steps, "replay_ms": one step's CUDA graph
    replayed alone (None without graphs), "profile": its top kernels (with `profile`)}; the requests are aborted
    after. The steps: common.timed_batch_steps."""
    ids, made, elapsed, _ = common.timed_batch_steps(engine, prompts, WARMUP_STEPS, steps)
    graph = decode_graph(engine, len(prompts))
    result = {"tok_s": made / elapsed, "tokens": made,
              "replay_ms": None if graph is None else common.median_ms(graph.replay, reps=20)}  # last step's inputs
    if profile and graph is not None:
        result["profile"] = common.cuda_profile(graph.replay, rows=12)
    common.abort_all(engine, ids)
    return result


def decode_graph(engine, batch: int):
    """The CUDA graph the engine's decode steps of its `batch` running sequences replay, None where it has none."""
    graphs = engine.runner.graphs
    if graphs is None:
        return None
    width = max(len(seq.block_table) for seq in engine.seqs.values())
    g = graphs.graphs.get(graphs.key(batch, width))
    return None if g is None else g.graph


def workload_run(engine, requests) -> dict:
    """The requests all added at once, stepped until done -> seconds, output tokens and tok/s. The engine's prefix
    cache is emptied first: requests timed a second time (HF's share of the workload) find none of their K/V."""
    from accel.batch import SamplingParams
    assert not engine.has_unfinished()
    engine.blocks.cached.clear()
    common.sync()
    t0 = time.perf_counter()
    ids = [engine.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p, n in requests]
    tokens = run_until_done(engine, ids)
    common.sync()
    elapsed = time.perf_counter() - t0
    return {"seconds": elapsed, "output_tokens": tokens, "output_tok_s": tokens / elapsed}


# ---- one model ----

def decode_rows(engine, cfg, weight_bytes: int, args, copy_tb_s: float) -> list[dict]:
    """engine.step and graph-replay tok/s per batch size, against the roofline."""
    rows = []
    for b in args.batch_sizes:
        prompts = decode_prompts(cfg, b, args.context, args.seed)
        r = decode_rate(engine, prompts, args.decode_steps, profile=b == args.profile_batch)
        roof = roofline_tok_s(weight_bytes, cfg, b, args.context + args.decode_steps / 2, copy_tb_s)
        replay = None if r["replay_ms"] is None else b / r["replay_ms"] * 1e3
        rows.append({"batch": b, "decode_tok_s": r["tok_s"], "replay_tok_s": replay, "roofline_tok_s": roof,
                     "roofline_pct": 100 * r["tok_s"] / roof,
                     "replay_roofline_pct": None if replay is None else 100 * replay / roof})
        if "profile" in r:
            print(f"B = {b}, one decode step's graph replay, top kernels:\n{r['profile']}", flush=True)
    return rows


def variant_rates(cfg, weights, args, rows: list[dict], column: str, **options) -> None:
    """Each row's decode tok/s again on an engine built with `options` (its own: each engine takes most of the
    free memory for its KV pool), into row[column]."""
    engine = new_engine(cfg, weights, args.device, max(args.batch_sizes), **engine_options(args), **options)
    for row in rows:
        prompts = decode_prompts(cfg, row["batch"], args.context, args.seed)
        row[column] = decode_rate(engine, prompts, args.decode_steps)["tok_s"]
    del engine
    common.free_gpu()


def model_rows(key: str, args) -> dict:
    """One model's rows; the copy bandwidth of its roofline measured right before its decode rows (common.
    copy_bandwidth: the best of several trials)."""
    import torch

    from accel.weights import random_weights
    cfg = common.model_config(key)
    device = args.device
    weights = random_weights(cfg, device, torch.bfloat16, seed=0)
    weight_bytes = weights.nbytes_per_token()
    copy_tb_s = common.copy_bandwidth(device)
    engine = new_engine(cfg, weights, device, max(args.batch_sizes), **engine_options(args))
    rows = decode_rows(engine, cfg, weight_bytes, args, copy_tb_s)
    result = {"model": common.MODELS[key], "weights_gb": weights.nbytes() / 1e9, "context": args.context,
              "decode_steps": args.decode_steps, "block_size": engine.blocks.block_size, "copy_tb_s": copy_tb_s,
              "decode": rows}
    jobs = workload(args.requests, args.seed, cfg.vocab_size) if args.requests else []
    hf_jobs = jobs[:args.hf_requests] if not args.skip_hf else []
    if jobs:
        result["workload"] = {"requests": len(jobs), "prompt_tokens": sum(len(p) for p, _ in jobs),
                              "ours": workload_run(engine, jobs)}
    if hf_jobs and len(hf_jobs) < len(jobs):  # HF runs the first requests: ours on the same ones too
        result["workload"]["hf_requests"] = len(hf_jobs)
        result["workload"]["ours_on_hf_requests"] = workload_run(engine, hf_jobs)
    del engine
    common.free_gpu()
    if args.eager:
        variant_rates(cfg, weights, args, rows, "eager_tok_s", cuda_graphs=False)
    if not args.skip_invariant:
        variant_rates(cfg, weights, args, rows, "invariant_tok_s", batch_invariant=True)
        for row in rows:
            row["invariant_cost_pct"] = 100 * (1 - row["invariant_tok_s"] / row["decode_tok_s"])
    if not args.skip_hf:
        model, impl = common.hf_model(cfg, weights, device)
        result["hf_attn_implementation"], result["hf_cuda_graphs"] = impl, args.hf_cuda_graphs
        for row in rows:
            prompts = decode_prompts(cfg, row["batch"], args.context, args.seed)
            try:
                row["hf_tok_s"] = common.hf_decode_rate(model, prompts, args.decode_steps, args.hf_cuda_graphs)
            except Exception as e:  # noqa: BLE001  as for the workload below
                row["hf_tok_s"], row["hf_error"] = None, f"{type(e).__name__}: {e}"[:300]
                print(f"HF generate_batch at B={row['batch']} failed: {row['hf_error']}", flush=True)
            row["speedup_vs_hf"] = row["decode_tok_s"] / row["hf_tok_s"] if row["hf_tok_s"] else None
        if hf_jobs:
            w = result["workload"]
            try:
                w["hf"] = common.hf_workload(model, hf_jobs, args.hf_cuda_graphs)
            except Exception as e:  # noqa: BLE001  HF failing (its manager, memory) is a result, not the end of the run
                w["hf_error"] = f"{type(e).__name__}: {e}"[:300]
                print(f"HF's workload failed: {w['hf_error']}", flush=True)
            else:
                ours = w.get("ours_on_hf_requests", w["ours"])
                w["speedup_vs_hf"] = ours["output_tok_s"] / w["hf"]["output_tok_s"]
        del model
    del weights
    common.free_gpu()
    return result


def _fmt(x, spec=".1f") -> str:
    return "-" if x is None else format(x, spec)


def render(rec: dict) -> str:
    f = _fmt
    lines = [f"batched decode — {rec['device']} — {rec['date']}", f"copy bandwidth {rec['copy_tb_s']:.2f} TB/s", ""]
    for m in rec["models"]:
        blocks = f", KV blocks of {m['block_size']}" if m.get("block_size") else ""
        lines.append(f"{m['model']}: {m['context']}-token contexts, {m['decode_steps']} decode steps timed{blocks}")
        if m.get("copy_tb_s"):
            lines.append(f"copy bandwidth before its rows {m['copy_tb_s']:.2f} TB/s (its roofline's)")
        lines.append(f"{'B':>5}{'tok/s':>11}{'roofline':>11}{'% roof':>8}{'HF tok/s':>11}{'x HF':>7}"
                     f"{'replay':>11}{'% roof':>8}{'eager':>11}{'invariant':>11}{'cost %':>8}")
        for r in m["decode"]:
            lines.append(f"{r['batch']:>5}{r['decode_tok_s']:>11.0f}{r['roofline_tok_s']:>11.0f}"
                         f"{r['roofline_pct']:>8.1f}{f(r.get('hf_tok_s'), '.0f'):>11}{f(r.get('speedup_vs_hf')):>7}"
                         f"{f(r.get('replay_tok_s'), '.0f'):>11}{f(r.get('replay_roofline_pct')):>8}"
                         f"{f(r.get('eager_tok_s'), '.0f'):>11}{f(r.get('invariant_tok_s'), '.0f'):>11}"
                         f"{f(r.get('invariant_cost_pct')):>8}")
        w = m.get("workload")
        if w:
            hf = w.get("hf")
            lines.append(f"workload: {w['requests']} requests, {w['prompt_tokens']} prompt tokens; ours "
                         f"{w['ours']['seconds']:.1f} s, {w['ours']['output_tok_s']:.0f} output tok/s")
            sub = w.get("ours_on_hf_requests")
            if sub:
                lines.append(f"  its first {w['hf_requests']} requests: ours {sub['seconds']:.1f} s, "
                             f"{sub['output_tok_s']:.0f} output tok/s")
            if w.get("hf_error"):
                lines.append(f"  HF failed: {w['hf_error']}")
            if hf:
                lines.append(f"  HF on {w.get('hf_requests', w['requests'])} requests: {hf['seconds']:.1f} s, "
                             f"{hf['output_tok_s']:.0f} output tok/s (ours x{w['speedup_vs_hf']:.1f})"
                             + (f"; HF's configuration {hf['config']}" if hf.get("config") else ""))
        lines.append("")
    lines.append("(tok/s: engine.step() as called; replay: its CUDA graph alone; eager: an engine without graphs; "
                 "invariant: an engine in batch-invariant mode, cost % its tok/s below the default engine's; "
                 "roofline: the weights once + every sequence's K/V a step, over the copy bandwidth; HF: "
                 "generate_batch's time for 1 + steps tokens minus for 1 token)")
    return "\n".join(lines)


def arg_parser():
    ap = common.parser("tools.bench.batch", __doc__, models="1b,3b")
    ap.add_argument("--batch-sizes", type=batch_sizes, default=list(BATCH_SIZES),
                    help="comma-separated (default 1,8,32,64,128,256)")
    ap.add_argument("--context", type=int, default=512, help="prompt tokens of each decoding sequence")
    ap.add_argument("--decode-steps", type=int, default=64, help="decode steps timed at each batch size")
    ap.add_argument("--requests", type=int, default=1000, help="the offline workload's requests (0: skip it)")
    ap.add_argument("--hf-requests", type=int, default=HF_REQUESTS,
                    help=f"HF runs the workload's first N requests (ours runs them too, for the speedup; default "
                         f"{HF_REQUESTS})")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--block-size", type=int, default=None,
                    help="the KV pool's block size in tokens (default: the engine's, accel.batch.engine)")
    ap.add_argument("--skip-hf", action="store_true", help="skip HF transformers' continuous batching")
    ap.add_argument("--hf-cuda-graphs", choices=("on", "auto", "off"), default="on",
                    help="HF continuous batching's CUDA graphs (auto: transformers decides; default on)")
    ap.add_argument("--skip-invariant", action="store_true",
                    help="skip the batch-invariant engine's decode rates (its cost against the default engine)")
    ap.add_argument("--eager", action="store_true", help="also decode on an engine without CUDA graphs")
    ap.add_argument("--profile-batch", type=int, default=None, metavar="B",
                    help="print the top kernels of batch size B's decode graph replay")
    ap.add_argument("--device", default="cuda")
    return ap


def main(argv=None):
    ap = arg_parser()
    args = ap.parse_args(argv)
    for name in ("context", "decode_steps", "block_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.requests < 0 or args.hf_requests < 0:
        ap.error(f"--{'requests' if args.requests < 0 else 'hf-requests'} must be >= 0")
    common.require_cuda("python3 -m tools.bench.batch")
    return run(args)


def run(args, command: str | None = None) -> dict:
    rec = common.record(args.device, command=command, models=[])
    for key in args.models:
        print(f"benchmarking batched decode, {common.MODELS[key]} ...", flush=True)
        rec["models"].append(model_rows(key, args))
    rec["copy_tb_s"] = max(m["copy_tb_s"] for m in rec["models"])
    print(render(rec), flush=True)
    common.write_record(args.json_out, rec)
    return rec


if __name__ == "__main__":
    main()
