"""Decode GEMV launch configs (accel/kernels/gemv.py) against cuBLAS, as the decode step runs them: the sweep that
regenerates accel/kernels/tuning.py's GEMV table.

    python3 -m tools.bench.sweeps.gemv OUT_DIR [--models 1b,3b] [--budget S] [--decode]

For each Llama 3.2 shape it times, per call:
    cublas        F.linear alone;
    unfused       the sequence the fused GEMV replaces (rms_norm + F.linear; F.linear + add; swiglu + F.linear
                  + add), all cuBLAS/Triton launches;
    gemv[cfg]     the fused Triton GEMV per GemvConfig (kind persist / split / stream, tiles, warps, programs),
                  each checked first against a float64 product of the same f(x) (bf16 tolerance) and for
                  bitwise-equal repeats; a config that fails either check (or to compile) is not timed.
Writes OUT_DIR/gemv_sweep.json (the winner per shape). With --decode, `decode_compare` then times the engine's
greedy decode with the built-in table and with the sweep's winners merged into it, passed to the engine as a
`Tuning`, in one process on the same weights, and writes the faster table per model as OUT_DIR/gemv_choice.json:
copy its rows into accel/kernels/tuning.py's GEMV by hand, with the numbers in docs/performance.md. --budget S:
past S seconds only the built-in configs are timed.
Timing: common.graph_us, one CUDA graph holding one call per weight copy, >= 256 MB of copies (> the L2, as a
decode step's layers are), replayed 10 times; median per call in µs.
"""
from __future__ import annotations

import json
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from accel.kernels import tuning
from accel.kernels.common import sm_count
from accel.kernels.gemv import gemv_config, gemv_fwd
from accel.kernels.rms_norm import rms_norm_fwd
from accel.kernels.swiglu import swiglu_gate_up_fwd
from accel.kernels.tuning import GemvConfig, Tuning
from tools.bench.common import (decode_gemv_shapes, decode_rate, graph_us, model_config, parser, record,
                                require_cuda, write_record)


def shapes(model: str) -> dict:
    """The decode GEMVs of a model but the lm_head, qkv as the plain norm GEMV (name -> (N, K, fusion))."""
    return {what: (N, K, "norm" if fusion == "rope" else fusion)
            for what, (N, K, fusion) in decode_gemv_shapes(model_config(model)).items() if what != "lm_head"}


# (BLOCK_N, BLOCK_K, warps) of the split kernel: 8-64 KB tiles (one a program, all loads at once), 2-8 warps;
# compiled for sm_90 first: 48-168 registers, no spills, 16-byte loads
SPLIT_TILES = [(8, 1024, 4), (16, 1024, 4), (32, 1024, 4), (8, 2048, 8), (16, 2048, 8), (32, 2048, 8),
               (16, 512, 4), (32, 512, 4), (64, 512, 4), (32, 1024, 8)]
# (BLOCK_N, BLOCK_K, warps, programs an SM, stages) of the streaming kernel: the winners so far
STREAM_TILES = [(8, 512, 4, 3, 4), (8, 512, 4, 4, 4), (16, 512, 4, 2, 3)]
DEADLINE = float("inf")  # time.time() past which only the built-in table's configs are timed (main's budget)


def candidates(N: int, K: int, sms: int) -> list[GemvConfig]:
    blocks = lambda bn: -(-N // bn)  # noqa: E731
    even = lambda bn, per: -(-blocks(bn) // -(-blocks(bn) // (per * sms)))  # noqa: E731  row blocks dealt evenly
    out = []
    base = [tuning.GEMV.get((N, K)), gemv_config(N, K, sms, table={}), GemvConfig("persist", 4, 1024, 4, even(4, 3))]
    out += [c for c in base if c is not None]
    for bn, bk, warps in SPLIT_TILES:
        if bk <= K and K % bk == 0 and blocks(bn) * (K // bk) >= sms:
            out.append(GemvConfig("split", bn, bk, warps, None))
    for bn, bk, warps, per, stages in STREAM_TILES:
        if K % bk == 0:
            out.append(GemvConfig("stream", bn, bk, warps, min(per * sms, blocks(bn)), stages))
    out = list(dict.fromkeys(out))
    return out if time.time() < DEADLINE else out[:2]


def sweep_shape(N: int, K: int, fusion: str, dtype=torch.bfloat16, device: str = "cuda", timer=graph_us,
                min_bytes: int = 256 * 2**20, configs: list[GemvConfig] | None = None) -> dict:
    """Times `configs` (default: `candidates`) at one shape."""
    dev = torch.device(device)
    copies = max(4, -(-min_bytes // (N * K * 2)))
    g = torch.Generator(device=dev).manual_seed(N + K)
    ws = [(torch.randn(N, K, device=dev, generator=g) * K ** -0.5).to(dtype) for _ in range(copies)]
    x = (3 * torch.randn(1, 2 * K if fusion == "swiglu" else K, device=dev, generator=g)).to(dtype)
    nw = (1 + 0.1 * torch.randn(K, device=dev, generator=g)).to(dtype)
    resid = torch.randn(1, N, device=dev, generator=g).to(dtype)
    resid0 = resid.clone()  # the timed calls below keep adding into resid
    xin = x[:, :K] if fusion == "norm" else swiglu_gate_up_fwd(x) if fusion == "swiglu" else x
    fx = rms_norm_fwd(x, nw, 1e-5) if fusion == "norm" else xin
    want = fx.double() @ ws[0].double().T  # [1, K] @ [K, N] -> [1, N], float64
    if fusion != "norm":
        want = want.to(dtype).double() + resid0.double()

    def fused(w, cfg, r):
        if fusion == "norm":
            return lambda: gemv_fwd(w, x, norm_weight=nw, eps=1e-5, config=cfg)
        return lambda: gemv_fwd(w, x, swiglu=fusion == "swiglu", residual=r, out=r, config=cfg)

    def unfused(w):
        if fusion == "norm":
            return lambda: F.linear(rms_norm_fwd(x, nw, 1e-5), w)
        if fusion == "swiglu":
            return lambda: resid.add_(F.linear(swiglu_gate_up_fwd(x), w))
        return lambda: resid.add_(F.linear(x, w))

    row = {"N": N, "K": K, "fusion": fusion, "copies": copies, "mb": N * K * 2 / 1e6,
           "cublas_us": timer([lambda w=w: F.linear(xin, w) for w in ws]),
           "unfused_us": timer([unfused(w) for w in ws]), "configs": {}, "failed": {}}
    for cfg in configs if configs is not None else candidates(N, K, sm_count(dev)):
        key = json.dumps(list(cfg))
        try:
            outs = []
            for _ in range(3):
                r = resid0.clone()
                outs.append(fused(ws[0], cfg, r)().double())
            torch.cuda.synchronize()
            err = (outs[0] - want).abs()
            rel = ((outs[0] - want).norm() / want.norm()).item()
            ok = bool((err <= 2e-2 + 2e-2 * want.abs()).all()) and rel <= 1e-2
            same = all(torch.equal(outs[0], o) for o in outs[1:])
            if not (ok and same):
                row["failed"][key] = f"max err {err.max().item():.3g} rel {rel:.3g} repeat-equal {same}"
                continue
            row["configs"][key] = timer([fused(w, cfg, resid) for w in ws])
        except Exception as e:  # a config that does not compile (resources) or launch: reported, not timed
            row["failed"][key] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            torch.cuda.synchronize()
    if not row["configs"]:
        raise RuntimeError(f"no GEMV config passed at {N}x{K} {fusion}: {row['failed']}")
    best = min(row["configs"], key=row["configs"].get)
    row["best_config"], row["best_us"] = json.loads(best), row["configs"][best]
    row["unfused_faster"] = row["unfused_us"] < row["best_us"]
    row["best_tb_s"] = N * K * 2 / (row["best_us"] * 1e-6) / 1e12
    del ws
    torch.cuda.empty_cache()
    return row


def write_choice(rows, path):
    """Per shape the sweep's best config (and whether the unfused cuBLAS sequence beat it)."""
    out = [{"N": r["N"], "K": r["K"], "model": r["model"], "proj": r["proj"], "best_config": r["best_config"],
            "best_us": r["best_us"], "unfused_us": r["unfused_us"], "unfused_faster": r["unfused_faster"]}
           for r in rows]
    write_record(path, record(rows=out))


def swept_tuning(rows) -> Tuning:
    """The built-in tables with the sweep's winners in place of their shapes' rows."""
    return Tuning(gemv={**tuning.GEMV, **{(r["N"], r["K"]): GemvConfig(*r["best_config"]) for r in rows}})


def decode_compare(tunings: dict[str, Tuning], models=("1b", "3b"), new_tokens: int = 128) -> list[dict]:
    """Greedy decode tok/s of the engine per launch table, same weights and process. Also: how many greedy
    tokens agree with the first table's, and the first step's logits' relative error."""
    from accel.engine import AccelEngine
    from accel.weights import random_weights
    rows = []
    for m in models:
        cfg = model_config(m)
        w = random_weights(cfg, "cuda", torch.bfloat16, seed=0)
        ref_tokens = ref_logits = None
        for tag, tun in tunings.items():
            eng = AccelEngine(cfg, w, torch.device("cuda"), "bf16", tuning=tun)
            rate, prompt, tokens = decode_rate(eng, 32, new_tokens, reps=3)
            sess = eng.session(64)
            logits = eng.prefill(prompt, sess)
            step = sess.decoder.step(torch.tensor([tokens[0]], device="cuda"), 32).float().clone()
            if ref_tokens is None:
                ref_tokens, ref_logits = tokens, step
            agree = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), len(tokens))
            rel = ((step - ref_logits).norm() / ref_logits.norm()).item()
            rows.append({"model": m, "table": tag, "decode_tok_s": rate, "tokens_agree_with_first": agree,
                         "step_logits_rel_err_vs_first": rel})
            print(f"decode {m} table={tag:<8} {rate:8.1f} tok/s  greedy agree {agree}/{len(tokens)}  "
                  f"logits rel {rel:.2e}", flush=True)
            del eng, sess, logits
            torch.cuda.empty_cache()
        del w
        torch.cuda.empty_cache()
    return rows


def write_final(rows, res, path) -> dict:
    """Per model, the table whose decode was fastest in decode_compare (builtin or best), as one JSON."""
    pick = {m: max((r for r in res if r["model"] == m), key=lambda r: r["decode_tok_s"])["table"]
            for m in {r["model"] for r in res}}
    out = []
    for r in rows:
        tag = pick.get(r["model"], "best")
        cfg = tuning.GEMV.get((r["N"], r["K"])) if tag == "builtin" else GemvConfig(*r["best_config"])
        out.append({"N": r["N"], "K": r["K"], "model": r["model"], "proj": r["proj"], "table": tag,
                    "best_config": list(cfg) if cfg else None, "best_us": r["best_us"], "unfused_us": r["unfused_us"]})
    write_record(path, record(pick=pick, rows=out))
    return pick


def main(argv: list[str] | None = None) -> None:
    ap = parser("tools.bench.sweeps.gemv", __doc__, models="1b,3b", json_out=False)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--budget", type=float, default=float("inf"), help="seconds; past them only the table's configs")
    ap.add_argument("--decode", action="store_true", help="then time the engine's decode with each table")
    args = ap.parse_args(argv)
    require_cuda("python3 -m tools.bench.sweeps.gemv")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    t0, rows = time.time(), []
    global DEADLINE
    DEADLINE = t0 + args.budget
    print(f"{'shape':<14}{'MB':>6}{'cuBLAS':>8}{'unfused':>9}{'table':>8}{'best':>8}{'TB/s':>6}  best cfg")
    for model in args.models:
        for name, (N, K, fusion) in shapes(model).items():
            try:
                r = sweep_shape(N, K, fusion)
            except Exception:
                traceback.print_exc()
                continue
            r["model"], r["proj"] = model, name
            rows.append(r)
            table = tuning.GEMV.get((N, K))
            t_table = r["configs"].get(json.dumps(list(table))) if table else None
            print(f"{model + ' ' + name:<14}{r['mb']:>6.1f}{r['cublas_us']:>8.2f}{r['unfused_us']:>9.2f}"
                  f"{t_table or float('nan'):>8.2f}{r['best_us']:>8.2f}{r['best_tb_s']:>6.2f}"
                  f"  {r['best_config']}{' (unfused faster)' if r['unfused_faster'] else ''}"
                  f"  failed {len(r['failed'])}",
                  flush=True)
            for k, v in sorted(r["configs"].items(), key=lambda kv: kv[1])[:6]:
                print(f"      {v:7.2f}  {k}")
            for k, v in list(r["failed"].items())[:3]:
                print(f"      FAILED {k}: {v}")
    write_record(args.out_dir / "gemv_sweep_all.json", record(rows=rows))
    write_choice(rows, args.out_dir / "gemv_sweep.json")
    print(f"sweep {time.time() - t0:.0f} s", flush=True)
    if args.decode:
        res = decode_compare({"builtin": tuning.DEFAULT, "best": swept_tuning(rows)}, args.models)
        write_record(args.out_dir / "decode_compare.json", record(rows=res))
        print("chosen table per model:", write_final(rows, res, args.out_dir / "gemv_choice.json"), flush=True)
        print(f"sweep + decode {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
