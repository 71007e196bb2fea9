"""The quantized prefill's paths, measured side by side (accel/kernels/qdequant.py, accel.quant_ops):

    layer    the engine's: one dequantize launch a layer (a format) into a bf16 scratch, then cuBLAS
    dequant  one dequantize launch a matrix into a scratch per shape, then cuBLAS
    gemm     the Triton GEMM that dequantizes its weight tiles in registers before tl.dot

    python3 -m tools.bench.quant_prefill [--out DIR] [--models 1b,3b] [--specs int8,int4:64] [--parts engine,kernels]
                                         [--paths layer,dequant] [--rounds 9]

Per matrix shape of each model (qkv, o, gate_up, down): the dequantize kernel alone (µs, TB/s of bytes read +
written) over a few tile shapes; then at M = 16 .. 2048 rows of input, bf16 cuBLAS, dequant + cuBLAS, and the
fused GEMM over a few tile configs (µs, device time behind a spin). Then the engine's 2048-token prefill (random
weights at the real shapes; as called, the host's time to queue it, and GPU time) in bf16 and, per format, through
each path, the engines called in turn (engine_rows). Every fused-GEMM
output is checked against dequant + cuBLAS before it is timed. Prints a table; writes DIR/quant_prefill_<parts>.json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import sys
import time

import torch
import torch.nn.functional as F

from accel.engine import AccelEngine
from accel.kernels.qdequant import QGemmConfig, dequantize_fwd, qgemm_fwd
from accel.quant_layers import quantize_weights
from accel.quant_ops import prefill_path, quantize
from accel.weights import random_weights
from refimpl.model.config import PRESETS
from refimpl.quant.schemes import QuantSpec
from tools.bench.gpu import prefill_call, prefill_gpu_ms, prompt_ids
from tools.bench.timing import device_ms, round_robin_ms

NAMES = {"1b": "llama-3.2-1b", "3b": "llama-3.2-3b"}
DEQUANT_BLOCKS = [(16, 512, 4), (32, 512, 8), (16, 1024, 8), (64, 256, 8)]
GEMM_CONFIGS = [None, QGemmConfig(128, 128, 64, 8, 4), QGemmConfig(128, 128, 128, 8, 3),
                QGemmConfig(128, 256, 64, 8, 3), QGemmConfig(64, 256, 64, 8, 3), QGemmConfig(64, 128, 64, 4, 4)]
ROWS = (16, 128, 512, 2048)
T0 = time.time()


def _us(fn) -> float:
    return device_ms(fn, reps=20, sleep_cycles=20_000_000) * 1e3


def shapes(cfg) -> dict[str, tuple[int, int]]:
    D, F_ = cfg.hidden_size, cfg.intermediate_size
    return {"qkv": (cfg.q_size + 2 * cfg.kv_size, D), "o": (D, cfg.q_size), "gate_up": (2 * F_, D), "down": (D, F_)}


def kernel_rows(model: str, specs: list[str], budget_s: float, rows: list[dict]) -> None:
    """Appends to `rows` as it goes, until `budget_s` seconds into the run."""
    cfg = PRESETS[NAMES[model]]
    g = torch.Generator(device="cuda").manual_seed(0)
    for what, (N, K) in shapes(cfg).items():
        w = (torch.randn(N, K, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
        for spec in specs:
            if time.time() - T0 > budget_s:
                return
            t = quantize(w, QuantSpec.parse(spec))
            scratch = torch.empty(N, K, device="cuda", dtype=torch.bfloat16)
            base = {"model": model, "matrix": what, "N": N, "K": K, "quant": spec}
            deq = lambda block=None: dequantize_fwd(t.q, t.scale, t.low, t.bits, t.offset, t.group, K,  # noqa: E731
                                                    scratch, block=block)
            for block in DEQUANT_BLOCKS:
                us = _us(lambda: deq(block))
                rows.append({**base, "kind": "dequant", "block": block, "us": us,
                             "tb_s": (t.nbytes + scratch.nbytes) / (us * 1e-6) / 1e12})
            for M in ROWS:
                x = torch.randn(M, K, device="cuda", generator=g).to(torch.bfloat16)
                row = {**base, "M": M, "bf16_us": _us(lambda: F.linear(x, w)),
                       "dequant_cublas_us": _us(lambda: F.linear(x, deq()))}
                ref = F.linear(x, deq()).float()
                for c in GEMM_CONFIGS if M in (128, 2048) else [None]:
                    name = "default" if c is None else "x".join(map(str, c[:3])) + f"w{c.warps}s{c.stages}"
                    try:
                        out = qgemm_fwd(x, t.q, t.scale, t.low, t.bits, t.offset, t.group, K, config=c).float()
                        err = ((out - ref).norm() / ref.norm()).item()
                        if not err < 1e-2:
                            row[f"gemm_{name}_error"] = f"wrong output, rel err {err:.2e}"
                            continue
                        row[f"gemm_{name}_us"] = _us(lambda: qgemm_fwd(x, t.q, t.scale, t.low, t.bits, t.offset,
                                                                       t.group, K, config=c))
                    except Exception as e:  # out of shared memory, ...
                        row[f"gemm_{name}_error"] = repr(e)[:200]
                gemm = {k: v for k, v in row.items() if k.startswith("gemm_") and k.endswith("_us")}
                if gemm:
                    best = min(gemm, key=gemm.get)
                    row["gemm_best"], row["gemm_best_us"] = best[5:-3], gemm[best]
                row["tflop_s_bf16"] = 2 * M * N * K / (row["bf16_us"] * 1e-6) / 1e12
                rows.append(row)
                print(row, flush=True)


PATHS = {"layer": None, "dequant": "dequant", "gemm": "gemm"}  # label -> accel.quant_ops.prefill_path


def engine_rows(model: str, specs: list[str], rows: list[dict], tokens: int = 2048, paths=("layer", "dequant"),
                rounds: int = 9) -> None:
    """bf16 and every (format, path) engine held at once and called in turn (timing.round_robin_ms): as called
    and the host's time to queue a call, medians; GPU time alone (behind a spin) once per row. Appends to `rows`."""
    cfg = PRESETS[NAMES[model]]
    prompt = torch.tensor(prompt_ids(cfg, tokens, seed=1), device="cuda")
    variants = []
    for spec in ["bf16"] + specs:
        weights = random_weights(cfg, "cuda", torch.bfloat16, seed=0)
        if spec != "bf16":
            weights = quantize_weights(weights, QuantSpec.parse(spec))
        fn = prefill_call(AccelEngine(cfg, weights, torch.device("cuda"), "bf16", use_graph=False), tokens, prompt)
        for path in paths if spec != "bf16" else ["cublas"]:
            variants.append((spec, path, fn))
    fns = {(spec, path): fn for spec, path, fn in variants}
    timed = round_robin_ms(fns, rounds, around=lambda label: prefill_path(PATHS.get(label[1])))
    for spec, path, fn in variants:
        with prefill_path(PATHS.get(path)):
            gpu_ms = prefill_gpu_ms(fn)
        called, host = timed[spec, path]
        rows.append({"model": model, "quant": spec, "path": path, "prefill_ms": called, "host_ms": host,
                     "prefill_gpu_ms": gpu_ms, "rounds": rounds})
        print(rows[-1], flush=True)
    del variants, fns
    torch.cuda.empty_cache()


def ratios(rows: list[dict]) -> None:
    base = {r["model"]: r for r in rows if r["quant"] == "bf16"}
    for r in (r for r in rows if r["model"] in base):
        r["ratio_vs_bf16"] = r["prefill_ms"] / base[r["model"]]["prefill_ms"]
        r["gpu_ratio_vs_bf16"] = r["prefill_gpu_ms"] / base[r["model"]]["prefill_gpu_ms"]


def table(res: dict) -> str:
    lines = ["dequantize kernel alone (µs, TB/s of bytes read + written), per block (rows, cols, warps):"]
    for r in res["kernels"]:
        if r.get("kind") == "dequant":
            lines.append(f"  {r['model']} {r['matrix']:<8}{r['quant']:<9}{str(r['block']):<16}{r['us']:8.1f}"
                         f"{r['tb_s']:7.2f}")
    lines.append("GEMM, µs: bf16 cuBLAS | dequant + cuBLAS | fused GEMM (best config)")
    for r in res["kernels"]:
        if "M" in r:
            lines.append(f"  {r['model']} {r['matrix']:<8}{r['quant']:<9}M={r['M']:<6}{r['bf16_us']:9.1f}"
                         f"{r['dequant_cublas_us']:9.1f}{r.get('gemm_best_us', float('nan')):9.1f} "
                         f"({r.get('gemm_best', '-')})")
    lines.append("engine prefill, ms as called (GPU), x bf16 (GPU), host ms to queue one:")
    for r in res["engine"]:
        lines.append(f"  {r['model']} {r['quant']:<9}{r['path']:<9}{r['prefill_ms']:8.2f} ({r['prefill_gpu_ms']:.2f})"
                     f"{r.get('ratio_vs_bf16', float('nan')):7.2f} ({r.get('gpu_ratio_vs_bf16', float('nan')):.2f})"
                     f"  host {r.get('host_ms', float('nan')):.2f}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--models", default="1b,3b")
    ap.add_argument("--specs", default="int8,int4:64")
    ap.add_argument("--budget-s", type=float, default=150, help="stop the kernel sweep after this many seconds")
    ap.add_argument("--parts", default="engine,kernels", help="engine (the prefills), kernels (the per-shape sweep)")
    ap.add_argument("--paths", default="layer,dequant", help=f"the engine's quantized paths, of {', '.join(PATHS)}")
    ap.add_argument("--rounds", type=int, default=9, help="round-robin rounds of the engine prefills")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # a timeout still writes what was measured
    import triton
    models = [m for m in args.models.split(",") if m]
    specs = [s for s in args.specs.split(",") if s]
    res = {"meta": {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")},
           "kernels": [], "engine": []}
    path = os.path.join(args.out, f"quant_prefill_{args.parts.replace(',', '_')}.json")
    try:
        if "engine" in args.parts:
            for m in models:
                engine_rows(m, specs, res["engine"], paths=args.paths.split(","), rounds=args.rounds)
        if "kernels" in args.parts:
            for m in models:
                kernel_rows(m, specs, args.budget_s, res["kernels"])
    finally:
        ratios(res["engine"])
        with open(path, "w") as f:
            json.dump(res, f, indent=1)
        print(table(res))


if __name__ == "__main__":
    main()
