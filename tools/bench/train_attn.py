"""FlashAttention backward (accel/kernels/flash_attn_bwd.py) against torch SDPA's backward, on the GPU.

    python -m tools.bench.train_attn [--json-out F] [--sweep] [--budget-s 300]

bf16, causal, B=1, 8 kv heads, S=2048 and 8192, E=64 (H=32, Llama 3.2 1B) and E=128 (H=24, 3B). Backward FLOPs
are counted as 2.5× the causal forward's (4·S²·E·H / 2), whatever each implementation actually computes.
SDPA runs with enable_gqa=True (no repeated K/V) under the flash backend, the cuDNN backend and torch's default
choice (the same as one of those two); where
a backend refuses enable_gqa it runs on K/V repeated per query head (outside the timed region; its backward then
omits the sum over the group, in SDPA's favour) and the row says `gqa: repeated`.
Both backwards are timed from a saved forward: ours flash_attn_bwd (dQ pass + dK/dV pass), SDPA's
torch.autograd.grad of the saved graph. Every gradient is checked against an fp32 SDPA reference before timing.
With --sweep, each pass's tile configurations are timed on their own and the fastest pair is reported too.
Prints a table; writes JSON.
"""
from __future__ import annotations

import argparse
import datetime
import json
import time

import torch
import torch.nn.functional as F

from accel.kernels.flash_attn_bwd import (default_configs, flash_attn_bwd, flash_attn_dkdv, flash_attn_dq,
                                          flash_attn_train_fwd)
from tools.bench.timing import device_ms, require_cuda

SHAPES = ((2048, 32, 64), (2048, 24, 128), (8192, 32, 64), (8192, 24, 128))  # S, H, E
KV = 8
DEV, DTYPE = "cuda", torch.bfloat16  # a CPU smoke test of this script swaps these (interpreter, fp32)

SWEEP_DQ = [dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s) for m, n, w, s in
            ((64, 64, 4, 3), (64, 64, 4, 4), (64, 64, 8, 3), (128, 64, 8, 3), (128, 64, 8, 4), (128, 32, 4, 3),
             (64, 32, 4, 4), (64, 128, 4, 3), (128, 128, 8, 3))]
_DKDV = ((64, 64, 4, 3), (32, 64, 4, 4), (64, 64, 8, 3), (32, 128, 4, 3), (32, 128, 8, 3), (64, 128, 8, 2),
         (64, 128, 8, 3), (64, 128, 8, 4), (128, 64, 8, 3))
SWEEP_DKDV = [dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s) for m, n, w, s in _DKDV]
# the head split (more programs on short sequences) on the tiles that led the first sweep
SWEEP_DKDV_SPLIT = [dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s) for m, n, w, s in
                    ((64, 64, 4, 3), (32, 64, 4, 4), (64, 128, 8, 3), (32, 128, 4, 3))]
SWEEP_FWD = [dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s) for m, n, w, s in
             ((64, 64, 4, 3), (64, 64, 4, 4), (128, 64, 8, 3), (64, 32, 4, 4), (64, 128, 4, 3))]


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def sdpa_backward(q, k, v, do, backend, gqa: bool):
    """A closure timing SDPA's backward from a saved forward, on [B, H, S, E] views of our [B, S, H, E] tensors."""
    from torch.nn.attention import sdpa_kernel
    G = q.shape[2] // k.shape[2]
    qs = q.detach().transpose(1, 2).requires_grad_()
    ks, vs = (x.detach().transpose(1, 2) for x in (k, v))
    if not gqa:
        ks, vs = ks.repeat_interleave(G, 1), vs.repeat_interleave(G, 1)
    ks, vs = ks.detach().requires_grad_(), vs.detach().requires_grad_()
    dos = do.transpose(1, 2)
    ctx = sdpa_kernel(backend) if backend is not None else torch.enable_grad()
    with ctx:
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=gqa)
        grads = torch.autograd.grad(o, (qs, ks, vs), dos, retain_graph=True)
    if not gqa:  # back to per-kv-head gradients for the check
        grads = (grads[0], *(g.unflatten(1, (-1, G)).sum(2) for g in grads[1:]))
    return (lambda: torch.autograd.grad(o, (qs, ks, vs), dos, retain_graph=True)), \
        [g.transpose(1, 2) for g in grads]


def bench_shape(S, H, E, sweep, rows, deadline):
    g = torch.Generator(device=DEV).manual_seed(S + E)
    q, k, v, do = (torch.randn(shape, device=DEV, dtype=DTYPE, generator=g)
                   for shape in ((1, S, H, E), (1, S, KV, E), (1, S, KV, E), (1, S, H, E)))
    fwd_tf = 4 * S * S * E * H / 2
    bwd_tf = 2.5 * fwd_tf
    base = {"S": S, "H": H, "K": KV, "E": E, "bwd_flop": bwd_tf}
    ref = sdpa_backward(q.float(), k.float(), v.float(), do.float(), None, True)[1]  # fp32 reference

    def record(variant, fn, grads, **extra):
        errs = [rel(a, b) for a, b in zip(grads, ref)]
        row = {**base, "variant": variant, "rel_err_dq_dk_dv": errs, **extra}
        if not max(errs) < 2e-2:
            rows.append({**row, "error": "wrong gradients"})
        else:
            ms = device_ms(fn, reps=10, sleep_cycles=200_000_000)
            rows.append({**row, "ms": ms, "tflop_s": bwd_tf / ms / 1e9})
        print(rows[-1], flush=True)

    from torch.nn.attention import SDPBackend
    for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("sdpa_default", None)):
        for gqa in (True, False):
            try:
                fn, grads = sdpa_backward(q, k, v, do, backend, gqa)
                record(name, fn, grads, gqa="enable_gqa" if gqa else "repeated")
                break
            except Exception as e:  # this backend refuses enable_gqa (or the shape): try repeated K/V
                rows.append({**base, "variant": name, "gqa": "enable_gqa" if gqa else "repeated",
                             "error": repr(e)[:300]})

    o, lse = flash_attn_train_fwd(q, k, v, True)
    ms_fwd = device_ms(lambda: flash_attn_train_fwd(q, k, v, True), reps=10, sleep_cycles=100_000_000)
    rows.append({**base, "variant": "ours_fwd_lse", "ms": ms_fwd, "tflop_s": fwd_tf / ms_fwd / 1e9})
    defaults = default_configs(1, S, S, KV, H, E, q.dtype, q.is_cuda)
    record("ours", lambda: flash_attn_bwd(q, k, v, o, lse, do, True), flash_attn_bwd(q, k, v, o, lse, do, True),
           configs={k_: defaults[k_] for k_ in ("dq", "dkdv")})
    if not sweep:
        return
    _, delta = flash_attn_dq(q, k, v, o, lse, do, True, None)
    dq_ref, dk_ref, dv_ref = flash_attn_bwd(q, k, v, o, lse, do, True)
    best = {}
    for cfg in SWEEP_FWD:  # the training forward (saves lse): not the target, but training runs it too
        if time.time() > deadline:
            break
        try:
            err = rel(flash_attn_train_fwd(q, k, v, True, config=cfg)[0], o)
            ms = device_ms(lambda c=cfg: flash_attn_train_fwd(q, k, v, True, config=c), reps=10,
                           sleep_cycles=100_000_000)
            rows.append({**base, "variant": "pass_fwd", "config": cfg, "rel_err_vs_default": err, "ms": ms,
                         "tflop_s": fwd_tf / ms / 1e9})
        except Exception as e:
            rows.append({**base, "variant": "pass_fwd", "config": cfg, "error": repr(e)[:200]})
        print(rows[-1], flush=True)
    G = H // KV
    splits = [{**c, "SPLIT": p} for p in range(2, G + 1) if G % p == 0 for c in SWEEP_DKDV_SPLIT]
    for part, configs in (("dq", SWEEP_DQ), ("dkdv", SWEEP_DKDV + splits)):
        for cfg in configs:
            if time.time() > deadline:
                rows.append({**base, "variant": f"pass_{part}", "config": cfg, "error": "skipped: time budget"})
                continue
            try:
                if part == "dq":
                    fn = lambda c=cfg: flash_attn_dq(q, k, v, o, lse, do, True, None, c)  # noqa: E731
                    err = rel(fn()[0], dq_ref)
                else:
                    fn = lambda c=cfg: flash_attn_dkdv(q, k, v, do, lse, delta, True, None, c)  # noqa: E731
                    dk, dv = fn()
                    err = max(rel(dk, dk_ref), rel(dv, dv_ref))
                row = {**base, "variant": f"pass_{part}", "config": cfg, "rel_err_vs_default": err}
                if not err < 1e-2:
                    rows.append({**row, "error": "wrong output"})
                    continue
                ms = device_ms(fn, reps=10, sleep_cycles=100_000_000)
                rows.append({**row, "ms": ms})
                if ms < best.get(part, (None, 1e9))[1]:
                    best[part] = (cfg, ms)
            except Exception as e:  # shared memory or registers exceeded
                rows.append({**base, "variant": f"pass_{part}", "config": cfg, "error": repr(e)[:200]})
            print(rows[-1], flush=True)
    if len(best) == 2:
        cfgs = {p: best[p][0] for p in best}
        record("ours_best_sweep", lambda: flash_attn_bwd(q, k, v, o, lse, do, True, configs=cfgs),
               flash_attn_bwd(q, k, v, o, lse, do, True, configs=cfgs), configs=cfgs)


def table(rows) -> str:
    lines = [f"{'S':>5} {'H':>3} {'E':>4}  {'variant':<16} {'gqa':<10} {'ms':>7} {'TFLOP/s':>8} {'vs sdpa_flash':>13}"]
    for key in dict.fromkeys((r["S"], r["H"], r["E"]) for r in rows):
        sub = [r for r in rows if (r["S"], r["H"], r["E"]) == key and "ms" in r and
               not r["variant"].startswith("pass_")]
        flash = next((r["ms"] for r in sub if r["variant"] == "sdpa_flash"), float("nan"))
        for r in sub:
            ratio = flash / r["ms"] if r["variant"] not in ("ours_fwd_lse",) else float("nan")
            lines.append(f"{key[0]:>5} {key[1]:>3} {key[2]:>4}  {r['variant']:<16} {r.get('gqa', ''):<10} "
                         f"{r['ms']:7.3f} {r['tflop_s']:8.1f} {ratio:13.3f}")
        for part in ("fwd", "dq", "dkdv"):
            ok = sorted((r for r in rows if (r["S"], r["H"], r["E"]) == key and r["variant"] == f"pass_{part}"
                         and "ms" in r), key=lambda r: r["ms"])
            lines += [f"      {part} {r['config']}: {r['ms']:.3f} ms" for r in ok[:3]]
        lines += [f"      FAIL {r['variant']} {r.get('config', r.get('gqa'))}: {r['error'][:90]}" for r in rows
                  if (r["S"], r["H"], r["E"]) == key and "error" in r]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json-out", default="train_attn.json")
    ap.add_argument("--sweep", action="store_true", help="also time each pass's tile configurations")
    ap.add_argument("--budget-s", type=float, default=300, help="stop sweeping after this many seconds")
    args = ap.parse_args()
    import triton
    require_cuda("tools.bench.train_attn")
    meta = {"device": torch.cuda.get_device_name(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__, "triton": triton.__version__, "dtype": "bf16", "causal": True, "B": 1,
            "flop_count": "backward = 2.5 x causal forward (4*S*S*E*H/2)"}
    rows: list[dict] = []
    deadline = time.time() + args.budget_s
    try:
        for S, H, E in SHAPES:
            bench_shape(S, H, E, args.sweep, rows, deadline)
    finally:
        with open(args.json_out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        print(meta)
        print(table(rows))


if __name__ == "__main__":
    main()
