"""The batched engine's paged decode attention (accel/kernels/paged_attn.py) alone per launch config, and one captured
decode step of the engine per kernel: the sweep behind paged_attn.py's GPU_CONFIG and split length.

    python3 -m tools.bench.sweeps.paged OUT_DIR [--models 1b,3b] [--batches 8,64,256] [--contexts 512,2048]
        [--budget S] [--step-batch B]

kernel    per model shape (heads H, kv heads K, head dim E), batch B and context: one call over B sequences of
          `context` tokens in randomly placed blocks of 16, its tables as wide as the engine's CUDA graphs pad them
          (accel/batch/graphs.py), captured in one CUDA graph with one call per copy of the K/V pools (>= 256 MB of
          them: the K/V come from HBM, as in a decode step's layers; common.graph_us). Per config: µs and the % of
          the copy bandwidth its bytes (every sequence's K and V) would take; each config checked first against the
          torch version (bf16 tolerance) and for bitwise-equal repeats (a failing one is not timed).
step      (first; --step-batch B, default 64; 0: skip) the engine on random bf16 weights of the first model, B sequences
          of the first context decoding: one decode step's CUDA graph replayed (ms, % of the roofline: weights once
          + every sequence's K/V over the copy bandwidth) and its kernels under torch.profiler (time and calls).
Writes OUT_DIR/paged_sweep.json. --budget S: S seconds after the start no further kernel config is timed.
"""
from __future__ import annotations

import gc
import json
import time
import traceback
from pathlib import Path

import torch

from accel.batch.graphs import MIN_WIDTH
from accel.kernels.paged_attn import paged_decode_attention_fwd
from accel.ops.paged import torch_paged_decode_attention
from tools.bench.common import (copy_bandwidth, cuda_profile, graph_us, median_ms, model_config, parser,
                                record, require_cuda)

BLOCK_SIZE = 16
L2_FLUSH_BYTES = 256 * 2**20  # K/V copies at least this large: each call reads from HBM
CONFIGS = {  # name -> (config, split_len); None: the defaults
    "default": (None, None),
    "split256": (None, 256),
    "n128_w4": ({"BLOCK_N": 128, "num_warps": 4}, None),
    "n64_w4": ({"num_warps": 4}, None),
    "n256_w8_s1": ({"BLOCK_N": 256, "num_warps": 8, "num_stages": 1}, None),
}


def graph_width(context: int) -> int:
    """The table width (blocks) the engine's graphs give sequences of `context` tokens."""
    w = MIN_WIDTH
    while w * BLOCK_SIZE < context:
        w *= 2
    return w


def kv_bytes(cfg, batch: int, context: int) -> int:
    """K and V of every sequence, one layer (bf16)."""
    return 2 * batch * context * cfg.num_key_value_heads * cfg.head_dim * 2


def case(cfg, batch: int, context: int, copies: int, seed: int = 0):
    """q [B, H, E], `copies` (cache_k, cache_v) pools of B·⌈context/16⌉ blocks each, tables [B, graph width]
    (blocks in a random order, unused columns 0), lens [B] = context."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    H, K, E = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    blocks = -(-context // BLOCK_SIZE)
    q = torch.randn(batch, H, E, device="cuda", dtype=torch.bfloat16, generator=g)
    pools = [tuple(torch.randn(K, batch * blocks * BLOCK_SIZE, E, device="cuda", dtype=torch.bfloat16, generator=g)
                   for _ in range(2)) for _ in range(copies)]
    tables = torch.zeros(batch, graph_width(context), device="cuda", dtype=torch.int32)
    tables[:, :blocks] = torch.randperm(batch * blocks, device="cuda", generator=g).view(batch, blocks).to(torch.int32)
    lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    return q, pools, tables, lens


def checked(fn, q, pools, tables, lens) -> str | None:
    """None if fn matches the torch version within bf16 tolerance and repeats bitwise, else why not."""
    ck, cv = pools[0]
    try:
        a = fn(q, ck, cv, tables, lens, BLOCK_SIZE)
        b = fn(q, ck, cv, tables, lens, BLOCK_SIZE)
        want = torch_paged_decode_attention(q, ck, cv, tables, lens, BLOCK_SIZE)
        torch.testing.assert_close(a.float(), want.float(), rtol=2e-2, atol=2e-2)
    except Exception as e:  # a config that fails to compile or to match is reported, not timed
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None if torch.equal(a, b) else "repeats differ"


def kernel_rows(model: str, batches, contexts, variants: dict, copy_tb_s: float, deadline: float,
                saved=lambda rows: None) -> list[dict]:
    """The rows of one model's shape; saved(rows so far) after each case."""
    cfg = model_config(model)
    rows = []
    for batch in batches:
        for context in contexts:
            nbytes = kv_bytes(cfg, batch, context)
            q, pools, tables, lens = case(cfg, batch, context, max(1, -(-L2_FLUSH_BYTES // nbytes)))
            for name, fn in variants.items():
                if time.time() > deadline:
                    break
                why = checked(fn, q, pools, tables, lens)
                us = None if why else graph_us([lambda ck=ck, cv=cv: fn(q, ck, cv, tables, lens, BLOCK_SIZE)
                                                for ck, cv in pools])
                pct = None if us is None else 100 * nbytes / (us * 1e-6) / (copy_tb_s * 1e12)
                rows.append({"model": model, "batch": batch, "context": context, "variant": name, "us": us,
                             "bandwidth_pct": pct, "error": why})
                print(f"{model:>3} B {batch:>3} ctx {context:>5} {name:<16}"
                      + (f"{us:8.1f} µs {pct:6.1f}% of copy bw" if us else f" failed: {why}"), flush=True)
            del q, pools
            saved(rows)
    return rows


def config_variants() -> dict:
    def bind(config, split_len):
        return lambda q, ck, cv, tables, lens, bs: paged_decode_attention_fwd(q, ck, cv, tables, lens, bs,
                                                                              split_len=split_len, config=config)
    return {name: bind(config, split_len) for name, (config, split_len) in CONFIGS.items()}


# ---- one decode step of the engine ----

def decode_engine(model: str, batch: int, context: int):
    """The engine on random bf16 weights with `batch` sequences of `context` random tokens past their prefill and
    two decode steps (the step's graph captured) -> (engine, weights' bytes a step reads)."""
    import random

    from accel.batch import BatchEngine, SamplingParams
    from accel.weights import random_weights
    cfg = model_config(model)
    weights = random_weights(cfg, "cuda", torch.bfloat16, seed=0)
    engine = BatchEngine(cfg, weights, torch.device("cuda"), "bf16", max_num_seqs=batch, gpu_memory=0.5)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=64, ignore_eos=True)  # past the steps timed here
    ids = [engine.add_request([rng.randrange(cfg.vocab_size) for _ in range(context)], params)
           for _ in range(batch)]
    started = set()
    while len(started) < len(ids):
        started |= {o.request_id for o in engine.step() if o.new_token_ids}
    for _ in range(2):
        engine.step()
    return engine, weights.nbytes_per_token()


def step_graph(engine):
    graphs = engine.runner.graphs
    width = max(len(seq.block_table) for seq in engine.seqs.values())
    return graphs.graphs[graphs.key(len(engine.seqs), width)].graph


def step_row(engine, weight_bytes: int, batch: int, copy_tb_s: float) -> dict:
    """The current decode step's graph replayed: ms, % of the roofline, and its kernels under the profiler."""
    cfg = engine.runner.cfg
    graph = step_graph(engine)
    ms = median_ms(graph.replay, reps=20)
    context = sum(seq.num_computed for seq in engine.seqs.values()) / batch
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2 * context * batch
    roof_ms = (weight_bytes + kv) / (copy_tb_s * 1e12) * 1e3
    row = {"batch": batch, "context": context, "replay_ms": ms, "roofline_ms": roof_ms,
           "roofline_pct": 100 * roof_ms / ms}
    row["profile"] = str(cuda_profile(graph.replay, rows=30))
    return row


def step_rows(model: str, batch: int, context: int, copy_tb_s: float, kernels: dict) -> list[dict]:
    """The step's replay with each paged kernel of `kernels` (name -> a paged_decode_attention_fwd), profiled, the
    graph captured again for each."""
    import accel.ops.paged as paged_ops
    from accel.batch.graphs import DecodeGraphs
    engine, weight_bytes = decode_engine(model, batch, context)
    shipped = paged_ops.paged_decode_attention_fwd
    rows = []
    try:
        for name, fn in kernels.items():
            paged_ops.paged_decode_attention_fwd = fn
            engine.runner.graphs = DecodeGraphs(engine.runner)  # a new pool: the old graphs' is freed with them
            for _ in range(2):
                engine.step()
            row = {"model": model, "kernel": name, **step_row(engine, weight_bytes, batch, copy_tb_s)}
            rows.append(row)
            print(f"{model} decode step, B {batch}, paged kernel {name}: {row['replay_ms']:.3f} ms, "
                  f"{row['roofline_pct']:.1f}% of the roofline ({row['roofline_ms']:.3f} ms)", flush=True)
            print(row["profile"], flush=True)
    finally:
        paged_ops.paged_decode_attention_fwd = shipped
    return rows


def sizes(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None, variants: dict | None = None, step_kernels: dict | None = None) -> dict:
    """variants: name -> a function with paged_decode_attention_fwd's first six arguments (default: CONFIGS);
    step_kernels: the paged kernels the step is timed with (default: the shipped one)."""
    ap = parser("tools.bench.sweeps.paged", __doc__, models="1b,3b", json_out=False)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--batches", type=sizes, default=[8, 64, 256])
    ap.add_argument("--contexts", type=sizes, default=[512, 2048])
    ap.add_argument("--budget", type=float, default=float("inf"), help="seconds of kernel timing at most")
    ap.add_argument("--step-batch", type=int, default=64, help="the decode step's batch (0: skip it)")
    args = ap.parse_args(argv)
    require_cuda("python3 -m tools.bench.sweeps.paged")
    deadline = time.time() + args.budget
    copy = copy_bandwidth("cuda")
    print(f"copy bandwidth {copy:.2f} TB/s", flush=True)
    rec = record("cuda", copy_tb_s=copy, kernel=[], step=[])
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / "paged_sweep.json"
    if args.step_batch:
        kernels = step_kernels or {"shipped": paged_decode_attention_fwd}
        try:
            rec["step"] = step_rows(args.models[0], args.step_batch, args.contexts[0], copy, kernels)
        except Exception:  # reported; the kernel sweep still runs
            traceback.print_exc()
        out.write_text(json.dumps(rec, indent=1))
        gc.collect()
        torch.cuda.empty_cache()
    variants = variants or config_variants()
    for model in args.models:
        done = list(rec["kernel"])
        kernel_rows(model, args.batches, args.contexts, variants, copy, deadline,
                    lambda rows: out.write_text(json.dumps({**rec, "kernel": done + rows}, indent=1)))
        rec = json.loads(out.read_text())
    return rec


if __name__ == "__main__":
    main()
