"""Decode GEMV shapes: the Triton GEMV (accel/kernels/gemv.py) against cuBLAS, as the decode step runs them.

`python3 -m accel.gemv_sweep [json_out]` on a CUDA GPU. For each Llama 3.2 shape it times, per call:
    cublas        F.linear alone (what v2 ran for the product);
    unfused       the v2 sequence the fused GEMV replaces (rms_norm + F.linear; F.linear + add; swiglu + F.linear
                  + add), all cuBLAS/Triton launches;
    gemv[cfg]     the fused Triton GEMV for several (BLOCK_N, BLOCK_K, warps, programs).
The choice per shape (the fastest config, or cuBLAS where the unfused sequence beats every config) is written to
the JSON; `apply(json)` installs it (gemv.TABLE, model.CUBLAS_SHAPES) so a bench in the same process measures it.
Timing: one CUDA graph holding one call per weight copy, >= 256 MB of copies (> the 50 MB L2, as a decode step's
layers are), replayed 20 times; median per call in µs (the graph's inter-kernel gap included, as in decode).
"""
from __future__ import annotations

import json
import statistics
import sys

import torch
import torch.nn.functional as F

from .kernels.gemv import _sm_count, gemv_config, gemv_fwd
from .kernels.rms_norm import rms_norm_fwd
from .kernels.swiglu import swiglu_gate_up_fwd

SHAPES = {"1b": {"qkv": (3072, 2048, "norm"), "o": (2048, 2048, "residual"), "gate_up": (16384, 2048, "norm"),
                 "down": (2048, 8192, "swiglu")},
          "3b": {"qkv": (5120, 3072, "norm"), "o": (3072, 3072, "residual"), "gate_up": (16384, 3072, "norm"),
                 "down": (3072, 8192, "swiglu")}}


def graph_us(calls, reps: int = 20) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up: compilation outside the capture
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(calls))
    return statistics.median(times)


def sweep_shape(N: int, K: int, fusion: str, dtype=torch.bfloat16, device: str = "cuda", timer=graph_us) -> dict:
    dev = torch.device(device)
    copies = max(4, -(-256 * 2**20 // (N * K * 2)))
    ws = [torch.randn(N, K, device=dev, dtype=dtype) * K ** -0.5 for _ in range(copies)]
    x = torch.randn(1, 2 * K if fusion == "swiglu" else K, device=dev, dtype=dtype)
    nw = 1 + 0.1 * torch.randn(K, device=dev, dtype=dtype)
    resid = torch.randn(1, N, device=dev, dtype=dtype)
    xin = x[:, :K] if fusion != "swiglu" else swiglu_gate_up_fwd(x)

    def fused(w, cfg):
        if fusion == "norm":
            return lambda: gemv_fwd(w, x, norm_weight=nw, eps=1e-5, config=cfg)
        return lambda: gemv_fwd(w, x, swiglu=fusion == "swiglu", residual=resid, out=resid, config=cfg)

    def unfused(w):
        if fusion == "norm":
            return lambda: F.linear(rms_norm_fwd(x, nw, 1e-5), w)
        if fusion == "swiglu":
            return lambda: resid.add_(F.linear(swiglu_gate_up_fwd(x), w))
        return lambda: resid.add_(F.linear(x, w))

    row = {"N": N, "K": K, "fusion": fusion, "copies": copies, "mb": N * K * 2 / 1e6,
           "cublas_us": timer([lambda w=w: F.linear(xin, w) for w in ws]),
           "unfused_us": timer([unfused(w) for w in ws])}
    sms = _sm_count(dev)
    default = gemv_config(N, K, sms)
    row["default_config"] = list(default)
    configs = {default}
    for bn, bk, warps in ((8, 1024, 4), (4, 1024, 4), (4, 2048, 8)):
        blocks = -(-N // bn)
        for per_sm in (1, 2, 3, 4, 5):
            configs.add((bn, bk, warps, -(-blocks // -(-blocks // (per_sm * sms)))))  # blocks dealt evenly
        configs.add((bn, bk, warps, None))  # one program a block
    for cfg in sorted(configs, key=str):
        row[f"gemv{list(cfg)}_us"] = timer([fused(w, cfg) for w in ws])
    row["gemv_plain_default_us"] = timer([lambda w=w: gemv_fwd(w, xin, config=default) for w in ws])
    best = min((k for k in row if k.startswith("gemv[")), key=row.get)
    row["best"], row["best_us"] = best, row[best]
    row["best_config"] = json.loads(best[4:-3].replace("None", "null"))
    row["best_tb_s"] = N * K * 2 / (row["best_us"] * 1e-6) / 1e12
    row["default_us"] = row[f"gemv{list(default)}_us"]
    row["use_cublas"] = row["unfused_us"] < row["best_us"]
    del ws
    torch.cuda.empty_cache()
    return row


def apply(path: str) -> None:
    """Install a sweep's choices: the best config per shape, cuBLAS where it won."""
    from . import model
    from .kernels import gemv
    for r in json.load(open(path))["rows"]:
        if r["use_cublas"]:
            model.CUBLAS_SHAPES.add((r["N"], r["K"]))
        else:
            gemv.TABLE[(r["N"], r["K"])] = tuple(r["best_config"])
    gemv.gemv_config.cache_clear()
    print("gemv table:", gemv.TABLE, "cuBLAS:", model.CUBLAS_SHAPES, flush=True)


def main(argv):
    rows = []
    print(f"{'shape':<16}{'MB':>6}{'cuBLAS':>8}{'unfused':>9}{'gemv def':>9}{'plain':>7}{'best':>8}{'TB/s':>6}  best cfg")
    for model, shapes in SHAPES.items():
        for name, (N, K, fusion) in shapes.items():
            r = sweep_shape(N, K, fusion)
            r["model"], r["proj"] = model, name
            rows.append(r)
            print(f"{model + ' ' + name:<16}{r['mb']:>6.1f}{r['cublas_us']:>8.2f}{r['unfused_us']:>9.2f}"
                  f"{r['default_us']:>9.2f}{r['gemv_plain_default_us']:>7.2f}{r['best_us']:>8.2f}"
                  f"{r['best_tb_s']:>6.2f}  {r['best']}{' -> cuBLAS' if r['use_cublas'] else ''}", flush=True)
    if len(argv) > 1:
        with open(argv[1], "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main(sys.argv)
