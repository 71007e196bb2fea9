"""Decode-step variants on a CUDA GPU, timed in one process on the same weights (tools/bench/NOTES.md).

`python3 -m tools.bench.decode_variants OUT_DIR [--models=1b,3b] [--sweep] [--stream] [--attention] [--profile]`:
  1. --sweep: the fused norm + qkv + RoPE + cache-write kernel (accel/kernels/qkv_rope.py) per config, against the
     unfused pair (GEMV with the norm prologue + rope_kv_write, UNFUSED_QKV), and the layers' GEMVs per split config, µs
     a call in a CUDA graph over >= 256 MB of weight copies (the layers' weights do not stay in the 50 MB L2 during
     decode either); every config is first checked against the unfused ops;
     --stream: the same for the streaming kernels (gemv kind "stream", qkv_rope with stages > 0; STREAM,
     QKV_STREAM) and the lm_heads, after a probe that the GPU's Triton pipelines the weight loads (cp.async);
  2. the engine's greedy decode (32-token prompt, 128 tokens, median of 3) with the built-in tables, then with
     the configs the sweep found > 1% faster than the tables' (GEMVs, then GEMVs and qkv), each passed to the
     engine as an accel.kernels.tuning.Tuning;
  3. --attention: the decode attention's split length and launch options in the engine (ATTENTION_VARIANTS);
     --attention-pdl: only its PDL launch on and off after long prompts (PDL_VARIANTS), and no step 2;
     --attention-long: only the long-cache launch against the one before it after a 32000-token prompt
     (LONG_VARIANTS), and no step 2;
  4. --profile: the per-kernel device time of eager decode steps of the fastest 1B variant.
Writes OUT_DIR/decode_variants.json. Copy the winners into accel/kernels/tuning.py by hand, with the numbers in
NOTES.md, which also lists the earlier rounds of this module (PDL modes, L2 prefetch, attention variants) and
their results files.
"""
from __future__ import annotations

import json
import sys
import time

import torch
import triton

from refimpl.model.config import PRESETS

from accel.engine import AccelEngine
from accel.kernels import tuning
from accel.kernels.common import sm_count
from accel.kernels.gemv import gemv_fwd
from accel.kernels.qkv_rope import qkv_rope_fwd
from accel.kernels.rope import rope_kv_write_fwd
from accel.kernels.tuning import GemvConfig, QkvConfig, Tuning
from accel.weights import random_weights
from tools.bench import gemv_sweep
from tools.bench.gemv_sweep import graph_us
from tools.bench.gpu import decode_rate, profile_decode

NAMES = {"1b": "llama-3.2-1b", "3b": "llama-3.2-3b"}
QKV_CONFIGS = [(1, 4), (2, 4), (2, 8), (4, 4), (4, 8), (8, 8)]  # (half_n, warps); 8 × 4096 spills (ptxas, sm_90)
# the GEMV configs of the unfused baseline's qkv (1B, 3B): the fastest of the GEMV sweeps before qkv_rope fused it
UNFUSED_QKV = {(3072, 2048): GemvConfig("split", 8, 2048, 8), (5120, 3072): GemvConfig("persist", 4, 1024, 4, 640)}


def unfused_qkv_rope(x, nw, w, eps, cos1, sin1, pos, ck, cv):
    """The pair qkv_rope replaces: norm + qkv GEMV, then rope_kv_write (cos1/sin1: the position's rows)."""
    NKV, _, E = ck.shape
    H = w.shape[0] // E - 2 * NKV
    qkv = gemv_fwd(w, x, norm_weight=nw, eps=eps, config=UNFUSED_QKV.get(tuple(w.shape)))  # [1, (H+2K)·E]
    q, k, v = (qkv[:, :H * E].view(1, H, E), qkv[:, H * E:(H + NKV) * E].view(1, NKV, E),
               qkv[:, (H + NKV) * E:].view(1, NKV, E))
    return rope_kv_write_fwd(q, k, v, cos1, sin1, ck, cv, pos)


def qkv_sweep(cfg, min_bytes: int = 256 * 2**20, configs=QKV_CONFIGS) -> dict:
    dev, dt = torch.device("cuda"), torch.bfloat16
    H, NKV, E, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
    N = (H + 2 * NKV) * E
    copies = max(4, -(-min_bytes // (N * D * 2)))
    g = torch.Generator(device=dev).manual_seed(N)
    ws = [(torch.randn(N, D, device=dev, generator=g) * D ** -0.5).to(dt) for _ in range(copies)]
    x = (3 * torch.randn(1, D, device=dev, generator=g)).to(dt)
    nw = (1 + 0.1 * torch.randn(D, device=dev, generator=g)).to(dt)
    S = 512
    cos = torch.rand(S, E // 2, device=dev, generator=g)
    sin = torch.rand(S, E // 2, device=dev, generator=g)
    pos = torch.tensor([300], device=dev)
    ck, cv = torch.zeros(NKV, S, E, device=dev, dtype=dt), torch.zeros(NKV, S, E, device=dev, dtype=dt)
    cos1, sin1 = cos.index_select(0, pos), sin.index_select(0, pos)

    def unfused(w):
        return unfused_qkv_rope(x, nw, w, 1e-5, cos1, sin1, pos, ck, cv)

    want_q = unfused(ws[0]).float().clone()
    want_k, want_v = ck[:, 300].float().clone(), cv[:, 300].float().clone()
    row = {"N": N, "K": D, "mb": N * D * 2 / 1e6, "unfused_us": graph_us([lambda w=w: unfused(w) for w in ws]),
           "configs": {}, "failed": {}}
    table = tuning.QKV_ROPE.get((N, D))
    for c in dict.fromkeys([QkvConfig(*c) for c in ([table] if table else []) + list(configs)]):
        if c.half_n > E // 2 or (not c.stages and c.half_n * triton.next_power_of_2(D) > 16384):
            continue
        ck.zero_()
        cv.zero_()
        try:
            q = qkv_rope_fwd(ws[0], x, nw, 1e-5, cos, sin, pos, ck, cv, config=c).float()
            errs = [((a - b).norm() / b.norm()).item() for a, b in
                    ((q, want_q), (ck[:, 300].float(), want_k), (cv[:, 300].float(), want_v))]
            if max(errs) > 1e-2:
                row["failed"][json.dumps(list(c))] = f"rel err {errs}"
                continue
            row["configs"][json.dumps(list(c))] = graph_us(
                [lambda w=w, c=c: qkv_rope_fwd(w, x, nw, 1e-5, cos, sin, pos, ck, cv, config=c)
                 for w in ws])
        except Exception as e:  # resources: reported, not timed
            row["failed"][json.dumps(list(c))] = f"{type(e).__name__}: {str(e)[:200]}"
    best = min(row["configs"], key=row["configs"].get)
    row["best"], row["best_us"] = json.loads(best), row["configs"][best]
    print(f"qkv_rope {N}x{D}: unfused {row['unfused_us']:.2f} µs, best {row['best']} {row['best_us']:.2f} µs  "
          + "  ".join(f"{k} {v:.2f}" for k, v in row["configs"].items()) + f"  failed {row['failed']}", flush=True)
    del ws
    torch.cuda.empty_cache()
    return row


def gemv_sweep_shapes(shapes, configs) -> list[dict]:
    """tools.bench.gemv_sweep.sweep_shape over explicit configs (plus the table's), µs a call in a graph."""
    rows = []
    for N, K, fusion in shapes:
        table = tuning.GEMV.get((N, K))
        r = gemv_sweep.sweep_shape(N, K, fusion, configs=list(dict.fromkeys([c for c in [table] if c] + configs)))
        print(f"gemv {N}x{K} {fusion}: cuBLAS {r['cublas_us']:.2f} unfused {r['unfused_us']:.2f}  "
              + "  ".join(f"{k} {v:.2f}" for k, v in sorted(r["configs"].items(), key=lambda kv: kv[1]))
              + f"  failed {r['failed']}", flush=True)
        rows.append(r)
    return rows


def engine_compare(model: str, table: dict, qkv_table: dict, new_tokens: int = 128) -> list[dict]:
    """Greedy decode tok/s per variant, same weights, same process; `table`, `qkv_table`: configs to try."""
    cfg = PRESETS[NAMES[model]]
    w = random_weights(cfg, "cuda", torch.bfloat16, seed=0)
    variants = [dict(name="greedy graph")]
    if table:
        variants.append(dict(name="greedy graph + swept GEMV table", table=table))
    if qkv_table:
        variants.append(dict(name="greedy graph + swept GEMV and qkv tables", table=table, qkv=qkv_table))
    rows = []
    for v in variants:
        tun = Tuning(gemv={**tuning.GEMV, **v.get("table", {})}, qkv_rope={**tuning.QKV_ROPE, **v.get("qkv", {})})
        eng = AccelEngine(cfg, w, torch.device("cuda"), "bf16", tuning=tun)
        rate, _, tokens = decode_rate(eng, 32, new_tokens, reps=3)
        row = {"model": model, "variant": v["name"], "decode_tok_s": rate, "tokens": tokens,
               "table": {str(k): list(c) for k, c in v.get("table", {}).items()},
               "qkv_table": {str(k): list(c) for k, c in v.get("qkv", {}).items()}}
        ref = next((r["tokens"] for r in rows if r["tokens"] is not None), None)
        row["agree_with_greedy_graph"] = None if tokens is None or ref is None else next(
            (i for i, (a, b) in enumerate(zip(tokens, ref)) if a != b), len(tokens))
        print(f"decode {model} {v['name']:<38} {rate:8.1f} tok/s  greedy agree {row['agree_with_greedy_graph']}",
              flush=True)
        rows.append(row)
        del eng
        torch.cuda.empty_cache()
    del w
    torch.cuda.empty_cache()
    return rows


# split-kernel (block_n, block_k, warps) tried per K besides the table's
SWEEP = {2048: [(4, 2048, 4), (8, 2048, 8), (4, 2048, 8), (2, 2048, 4), (8, 1024, 4)],
         3072: [(4, 4096, 4), (4, 4096, 8), (2, 4096, 4), (8, 2048, 8), (16, 1024, 4)],
         8192: [(8, 2048, 4), (32, 1024, 4), (16, 512, 4), (32, 512, 4), (16, 2048, 8)]}
LAYER_SHAPES = {"1b": [(2048, 2048, "residual"), (16384, 2048, "norm"), (2048, 8192, "swiglu")],
                "3b": [(3072, 3072, "residual"), (16384, 3072, "norm"), (3072, 8192, "swiglu")]}


ATTENTION_VARIANTS = [dict(), dict(split_len=32), dict(split_len=128), dict(config=dict(num_warps=2)),
                      dict(config=dict(num_warps=8)), dict(config=dict(num_stages=2)),
                      dict(split_len=32, config=dict(num_warps=2))]


# the decode attention's PDL launch (the engine's default from 8192 slots) with and without its L2 prefetch,
# against none, after long prompts (the cache then holds >= 8192 slots)
PDL_VARIANTS = [dict(), dict(config=dict(PREFETCH=0)), dict(pdl=False), dict()]
PDL_PROMPTS = (8000, 32000)
# the long-cache launch (from 16384 slots: 128-slot blocks, 3 stages, q late) against the 256-slot one it replaced
LONG_VARIANTS = [dict(), dict(config=dict(BLOCK_N=256, num_stages=2, LATE_Q=False)), dict()]


def attention_compare(model: str, new_tokens: int = 256, variants=ATTENTION_VARIANTS,
                      prompts=(32,)) -> list[dict]:
    """Greedy decode tok/s of the engine with the decode attention's split length / launch options overridden
    (the bench's 32 + 256 slots: 5 splits of 64 by default), same weights, same process."""
    cfg = PRESETS[NAMES[model]]
    w = random_weights(cfg, "cuda", torch.bfloat16, seed=0)
    rows = []
    for prompt, v in ((p, v) for p in prompts for v in variants):
        eng = AccelEngine(cfg, w, torch.device("cuda"), "bf16", tuning=Tuning(decode_attention=v))
        rate, _, tokens = decode_rate(eng, prompt, new_tokens, reps=3)
        rows.append({"model": model, "prompt": prompt, "attention": v, "decode_tok_s": rate})
        print(f"decode {model} prompt {prompt} attention {v}: {rate:8.1f} tok/s", flush=True)
        del eng
        torch.cuda.empty_cache()
    return rows


# kind "stream" (gemv._gemv_stream_kernel): (block_n, block_k, warps, programs per SM, stages); 8 × 1024,
# 4 × 1024, 16 × 256, 8 × 256 tiles and 8 warps were slower (NOTES.md)
STREAM = [(8, 512, 4, 4, 4), (8, 512, 4, 4, 3), (8, 512, 4, 4, 5), (8, 512, 4, 5, 4), (8, 512, 4, 3, 4),
          (16, 512, 4, 2, 4), (16, 512, 4, 3, 4), (16, 512, 4, 2, 3), (4, 512, 4, 6, 4), (16, 512, 4, 3, 3)]
# the streaming qkv_rope kernel: (half_n, warps, stages, block_k, programs per SM)
QKV_STREAM = [(4, 4, 4, 512, 4), (4, 4, 4, 512, 3), (8, 4, 4, 512, 2), (8, 4, 3, 512, 3), (2, 4, 4, 512, 4),
              (4, 4, 3, 1024, 2), (8, 8, 4, 512, 2), (4, 4, 5, 512, 3)]
LM_HEAD = {"1b": (128256, 2048, "norm"), "3b": (128256, 3072, "norm")}


def stream_probe() -> dict:
    """Does this Triton pipeline the stream kernel's weight loads through shared memory (cp.async)?"""
    dev = torch.device("cuda")
    w = torch.randn(3072, 3072, device=dev, dtype=torch.bfloat16)
    x = torch.randn(3072, device=dev, dtype=torch.bfloat16)
    y = torch.empty(3072, device=dev, dtype=torch.bfloat16)
    from accel.kernels.gemv import _gemv_stream_kernel
    k = _gemv_stream_kernel[(132,)](w, x, x, y, y, y, 3072, 3072, 3072, 1e-5, 384, PROLOGUE=0, HAS_RESIDUAL=False,
                                    HAS_GATE=False, BLOCK_N=8, BLOCK_K=512, K_POW2=1, STAGES=4, num_warps=4,
                                    num_stages=4)
    out = {"cp_async": k.asm["ptx"].count("cp.async"), "n_regs": getattr(k, "n_regs", None),
           "n_spills": getattr(k, "n_spills", None), "shared": k.metadata.shared}
    print(f"stream probe {out}", flush=True)
    return out


def qkv_winner(q: dict) -> dict:
    """{(N, K): the sweep's best qkv_rope config} where it beats the table's config by > 1%, else {}."""
    cur = tuning.QKV_ROPE.get((q["N"], q["K"]))
    if cur is None or q["best_us"] < 0.99 * q["configs"].get(json.dumps(list(cur)), float("inf")):
        return {(q["N"], q["K"]): QkvConfig(*q["best"])}
    return {}


def gemv_winner(r: dict) -> dict:
    """{(N, K): the sweep's best GEMV config} where it beats the table's config by > 1%, else {}."""
    cur = tuning.GEMV.get((r["N"], r["K"]))
    t_cur = r["configs"].get(json.dumps(list(cur))) if cur else None
    if t_cur is None or r["best_us"] < 0.99 * t_cur:
        return {(r["N"], r["K"]): GemvConfig(*r["best_config"])}
    return {}


def stream_sweep(models) -> tuple[list, dict, dict]:
    sms = sm_count(torch.device("cuda"))
    rows, tables, qkv_tables = [], {m: {} for m in models}, {m: {} for m in models}
    for m in models:
        cfg = PRESETS[NAMES[m]]
        q = qkv_sweep(cfg, configs=[(hn, w, st, bk, per * sms) for hn, w, st, bk, per in QKV_STREAM])
        q["model"] = m
        rows.append(q)
        qkv_tables[m] = qkv_winner(q)
        for N, K, f in LAYER_SHAPES[m] + [LM_HEAD[m]]:
            cands = [GemvConfig("stream", bn, bk, w, per * sms, st) for bn, bk, w, per, st in STREAM if K % bk == 0]
            r = gemv_sweep_shapes([(N, K, f)], cands)[0]
            r["model"] = m
            rows.append(r)
            tables[m].update(gemv_winner(r))
    return rows, tables, qkv_tables


def run_args(argv, **fields) -> tuple[str, list[str], dict]:
    """OUT_DIR [--models=1b,3b] -> (out_dir, models, the results record: device, date, torch and `fields`)."""
    out_dir = argv[1] if len(argv) > 1 and not argv[1].startswith("--") else "."
    models = next((a.split("=")[1] for a in argv if a.startswith("--models=")), "1b,3b").split(",")
    return out_dir, models, run_record(**fields)


def run_record(**fields) -> dict:
    """A results file's header: device, date, torch, then `fields`."""
    return {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "torch": torch.__version__, **fields}


def main(argv):
    out_dir, models, res = run_args(argv, qkv=[], decode=[])
    t0 = time.time()
    tables, qkv_tables = {m: {} for m in models}, {m: {} for m in models}
    if "--sweep" in argv:
        for m in models:
            res["qkv"].append(qkv_sweep(PRESETS[NAMES[m]]))
            qkv_tables[m] = qkv_winner(res["qkv"][-1])
            rows = [gemv_sweep_shapes([(N, K, f)], [GemvConfig("split", *c) for c in SWEEP[K]])[0]
                    for N, K, f in LAYER_SHAPES[m]]
            res.setdefault("gemv", []).extend(rows)
            for r in rows:
                tables[m].update(gemv_winner(r))
        print(f"sweeps {time.time() - t0:.0f} s; GEMV tables to try {tables}, qkv {qkv_tables}", flush=True)
    long = "--attention-long" in argv
    if "--attention" in argv or "--attention-pdl" in argv or long:
        for m in models:
            res.setdefault("attention", []).extend(
                attention_compare(m, variants=LONG_VARIANTS, prompts=(32000,)) if long else
                attention_compare(m, variants=PDL_VARIANTS, prompts=PDL_PROMPTS) if "--attention-pdl" in argv
                else attention_compare(m))
    for m in models if "--attention-pdl" not in argv and not long else ():
        res["decode"] += engine_compare(m, tables[m], qkv_tables[m])
    print(f"decode compare {time.time() - t0:.0f} s", flush=True)
    if "--profile" in argv:
        best = max((r for r in res["decode"] if r["model"] == models[0]), key=lambda r: r["decode_tok_s"])
        swept = {tuple(json.loads(k.replace("(", "[").replace(")", "]"))): GemvConfig(*c)
                 for k, c in best["table"].items()}
        res["profile"] = profile_decode(PRESETS[NAMES[models[0]]], "cuda", tuning=Tuning(gemv={**tuning.GEMV, **swept}))
        print(res["profile"], flush=True)
    with open(f"{out_dir}/decode_variants.json", "w") as f:
        json.dump(res, f, indent=1)
    print(f"total {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main(sys.argv)
