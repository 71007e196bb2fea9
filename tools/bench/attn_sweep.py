"""Tuning sweep for the attention kernels: one GPU call times many variants and configurations.

    python3 -m tools.bench.attn_sweep [--out DIR] [--budget-s 240]
    python3 -m tools.bench.attn_sweep --wide --contexts 8192,32768 --flash-seqs 2048   (the second sweep's grid)
    python3 -m tools.bench.attn_sweep --late --only decode --contexts 32768,16384,8192   (LATE_Q; PDL hand-off floor)

Flash forward (bf16, causal, GQA 8 kv heads, S=8192 at the 1B and 3B head shapes): SDPA (default choice, forced
flash, forced cuDNN) against our kernel over tile sizes, warps, stages, TMA descriptors. Decode attention (one query,
H=32 K=8 E=64 at 1k/8k/32k): split length, block, warps, stages, fused vs separate combine, on hot caches (the same
buffer every call, as tools.bench.gpu times it: at 1k/8k the cache sits in the 60 MB L2) and cold ones (rotating over
copies that together exceed the L2, as in the engine, where each layer's weights evict the cache).
Every variant's output is checked against SDPA (fp32 math on the same bf16 inputs) before it is timed; a fused
decode variant is also re-run on 30 fresh queries to catch a race in its last-program combine.
Prints a table last; writes everything to DIR/attn_sweep.json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from accel.kernels.common import gdc_launch_dependents, gdc_wait
from accel.kernels.decode_attn import decode_attention_fwd, default_split_len
from tools.bench import timing
from accel.kernels.flash_attn import flash_attention_fwd

T0 = time.time()


DEV = "cuda"
DTYPE = torch.bfloat16  # float32 in the CPU smoke test: the interpreter mis-computes bf16 (seen with triton 3.9)


def device_ms(fn, reps: int = 20, launches: int = 1) -> float:
    """tools.bench.timing.device_ms, with a spin long enough to cover queueing `reps` calls of `launches` kernels
    at <= 100 µs each (~1.9 GHz: 200k cycles a launch). On CPU (a smoke test of this script): wall time."""
    fn()
    if DEV != "cuda":
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    return timing.device_ms(fn, reps, sleep_cycles=max(10_000_000, reps * launches * 200_000))


def rel_err(got, ref) -> float:
    return ((got.float() - ref.float()).norm() / ref.float().norm()).item()


def read_bandwidth(nbytes: int) -> float:
    """TB/s of a sum over nbytes of bf16 (reads only): the streaming ceiling for decode attention."""
    x = torch.randn(nbytes // 2, device=DEV, dtype=torch.bfloat16)
    return nbytes / (device_ms(lambda: x.sum(), reps=20) * 1e-3) / 1e12


def flash_sweep(rows, budget_s, S=8192, shapes=((32, 64), (24, 128)), kv=8, smoke=False, configs=None):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    fixed, configs = configs, []
    for desc in (False, True):
        for bn in (64, 128):
            for st in (2, 3, 4):
                configs.append(dict(BLOCK_M=128, BLOCK_N=bn, num_warps=8, num_stages=st, USE_DESC=desc))
        configs.append(dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3, USE_DESC=desc))
        configs.append(dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3, USE_DESC=desc))
        configs.append(dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=3, USE_DESC=desc))
    if smoke:
        configs = [dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=3, USE_DESC=False), None]
    configs = fixed or configs
    for H, E in shapes:
        g = torch.Generator(device=DEV).manual_seed(S + H)
        q = torch.randn(S, H, E, device=DEV, dtype=DTYPE, generator=g)  # [T, H, E]
        k = torch.randn(kv, S, E, device=DEV, dtype=DTYPE, generator=g)  # [K, S, E]
        v = torch.randn(kv, S, E, device=DEV, dtype=DTYPE, generator=g)
        pos = torch.arange(S, device=DEV)
        qs = q.transpose(0, 1).unsqueeze(0).contiguous()  # [1, H, S, E]
        ks = k.repeat_interleave(H // kv, 0).unsqueeze(0)
        vs = v.repeat_interleave(H // kv, 0).unsqueeze(0)
        sdpa = lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)  # noqa: E731
        ref = F.scaled_dot_product_attention(qs.float(), ks.float(), vs.float(), is_causal=True)[0].transpose(0, 1)
        flops = 4 * S * S * E * H / 2
        base = {"kind": "flash", "S": S, "H": H, "E": E}
        for name, backend in (("sdpa_default", None), ("sdpa_flash", SDPBackend.FLASH_ATTENTION),
                              ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION))[:1 if smoke else 3]:
            try:
                if backend is None:
                    ms = device_ms(sdpa, 10)
                else:
                    with sdpa_kernel(backend):
                        ms = device_ms(sdpa, 10)
                rows.append({**base, "variant": name, "ms": ms, "tflop_s": flops / ms / 1e9})
            except Exception as e:  # a backend this build lacks
                rows.append({**base, "variant": name, "error": repr(e)[:200]})
        for cfg in configs:
            if time.time() - T0 > budget_s:
                rows.append({**base, "variant": "flash", "config": cfg, "error": "skipped: time budget"})
                continue
            try:
                out = torch.full_like(q, float("nan"))
                flash_attention_fwd(q, k, v, pos, out=out, config=cfg and dict(cfg))
                err = rel_err(out, ref)
                row = {**base, "variant": "flash", "config": cfg, "rel_err": err}
                if not err < 1e-2:
                    rows.append({**row, "error": "wrong output"})
                    continue
                ms = device_ms(lambda: flash_attention_fwd(q, k, v, pos, out=out, config=cfg and dict(cfg)), 10)
                rows.append({**row, "ms": ms, "tflop_s": flops / ms / 1e9})
            except Exception as e:
                rows.append({**base, "variant": "flash", "config": cfg, "error": repr(e)[:300]})
            print(rows[-1], flush=True)


def _decode_grid(S):
    splits = sorted({default_split_len(S), *(x for x in (64, 128, 256, 512, 1024) if S // x <= 256 and x <= S)})
    return [(dict(BLOCK_N=bn, num_warps=nw, num_stages=st, FUSED=fused), sl) for fused in (False, True)
            for bn in (64, 128) for nw in (4, 8) for st in (3, 4) for sl in splits if sl % bn == 0]


def _decode_grid_wide(S):
    """The second sweep: TMA descriptors, 256-slot blocks, 2-4 stages, at 16-64 splits (4 warps, fused combine)."""
    splits = (512, 1024, 2048) if S > 16384 else (256, 512)
    blocks = ((128, 3), (128, 4), (256, 2), (256, 3)) if S > 16384 else ((64, 3), (128, 3), (128, 4), (256, 2))
    return [(dict(BLOCK_N=bn, num_warps=4, num_stages=st, FUSED=True, USE_DESC=desc), sl) for desc in (False, True)
            for bn, st in blocks for sl in splits if sl % bn == 0 and (sl != 512 or S <= 16384 or bn == 128)]


# flash tiles for short prefills (T = 2048): (BLOCK_M, BLOCK_N, warps, stages, TMA)
FLASH_SHORT = [(128, 128, 8, 3, True), (128, 64, 8, 3, False), (128, 64, 8, 3, True), (128, 128, 8, 2, True),
               (64, 128, 4, 3, False), (64, 128, 4, 3, True), (64, 64, 4, 3, False), (64, 64, 4, 4, False),
               (128, 64, 4, 3, False), (64, 64, 4, 2, False)]


def _decode_grid_pdl(S):
    """The third sweep: PDL launches and L2 prefetch sizes around the long-cache defaults (TMA, 4 warps, fused)."""
    wide = dict(BLOCK_N=256, num_warps=4, num_stages=2, FUSED=True, USE_DESC=True)
    narrow = dict(BLOCK_N=128, num_warps=4, num_stages=3, FUSED=True, USE_DESC=True)
    grid = [(None, None), (dict(PDL=True, PREFETCH=0), None)] + [(dict(PDL=True, PREFETCH=p), None)
                                                                   for p in (32, 64, 128, 256)]
    grid += [(dict(PDL=True, PREFETCH=64, **c), None) for c in (dict(num_warps=8), dict(BLOCK_N=128, num_stages=3),
                                                                dict(BLOCK_N=128, num_stages=4))]
    for cfg in (wide, narrow):  # 64 splits
        grid.append(({**cfg, "PDL": True, "PREFETCH": 64}, 512 if S > 16384 else 128))
    return grid


def _decode_grid_late(S):
    """The fourth sweep (long caches): LATE_Q with 256-, 128- and 64-slot blocks (64-slot ones without LATE_Q need
    107 registers: two programs an SM fit beside qkv_rope's second wave), and the earlier long-cache default
    spelled out (PDL, 64-slot prefetch, 256 × 2, no LATE_Q)."""
    old = dict(PDL=True, BLOCK_N=256, num_stages=2, USE_DESC=True, FUSED=True, LATE_Q=False)
    grid = [old, {**old, "LATE_Q": True}]
    grid += [dict(PDL=True, BLOCK_N=bn, num_stages=st, LATE_Q=lq) for bn, st in ((128, 3), (64, 4), (64, 3), (128, 2))
             for lq in (False, True)]
    grid += [dict(PDL=True, BLOCK_N=128, num_stages=3, LATE_Q=True, PREFETCH=p) for p in (0, 128)]
    return [(cfg, None) for cfg in grid]


@triton.jit
def _wait_only(POS, OUT):
    """A PDL-launched program that reads the position, waits for the previous kernel and stores: the hand-off's
    own cost behind qkv_rope (the decode attention's floor as the step runs it)."""
    gdc_launch_dependents()
    p = tl.load(POS)
    gdc_wait()
    tl.store(OUT + tl.program_id(1) * tl.num_programs(0) + tl.program_id(0), p)


def handoff_floor(rows, S, H=32, K=8, E=64):
    """step_times of _wait_only over the 1B's decode grid (8 kv heads × 32 splits) behind qkv_rope."""
    caches = [(torch.randn(K, S, E, device=DEV, dtype=DTYPE), torch.randn(K, S, E, device=DEV, dtype=DTYPE))]
    pos = torch.tensor([S - 1], device=DEV)
    buf = torch.empty(K * 32, dtype=torch.int64, device=DEV)
    call = lambda *_: _wait_only[(K, 32)](pos, buf, launch_pdl=True)  # noqa: E731
    q = torch.empty(1, H, E, device=DEV, dtype=DTYPE)
    rows.append({"kind": "decode", "context": S, "variant": "handoff_floor",
                 **step_times(qkv_producer(S, H, K, E), call, q, caches, pos)})


def qkv_producer(S, H, K, E, device=None, dtype=None):
    """The kernel before decode attention in the decode step: qkv_rope (1B's D = 2048 at E = 64, 3B's 3072 else),
    writing q and the cache slot at `pos`. Returns f(q, cache_k, cache_v, pos)."""
    from accel.kernels.qkv_rope import qkv_rope_fwd
    device, dtype = device or DEV, dtype or DTYPE
    D = 2048 if E == 64 else 3072
    g = torch.Generator(device=device).manual_seed(D)
    w = torch.randn((H + 2 * K) * E, D, device=device, generator=g).mul_(D ** -0.5).to(dtype)
    x = torch.randn(1, D, device=device, generator=g).to(dtype)
    nw = torch.randn(D, device=device, generator=g).to(dtype)
    cos, sin = torch.randn(2, S, E // 2, device=device, generator=g)
    return lambda q, ck, cv, pos: qkv_rope_fwd(w, x, nw, 1e-5, cos, sin, pos, ck, cv, q_out=q)


def decode_sweep(rows, budget_s, contexts=(1024, 8192, 32768), H=32, K=8, E=64, variants=None, step=False):
    """step: also time each variant as the decode step runs it, behind qkv_producer (writing its q and the new
    slot): the device time the pair takes minus the producer's alone, hot and cold."""
    for S in contexts:
        g = torch.Generator(device=DEV).manual_seed(S)
        n_cold = min(64, max(2, -(-160 * 2**20 // (2 * K * S * E * 2))))  # >= 128 MB of copies (L2: 60 MB)
        caches = [(torch.randn(K, S, E, device=DEV, dtype=DTYPE, generator=g),
                   torch.randn(K, S, E, device=DEV, dtype=DTYPE, generator=g)) for _ in range(n_cold)]
        ck, cv = caches[0]
        q = torch.randn(1, H, E, device=DEV, dtype=DTYPE, generator=g)
        pos = torch.tensor([S - 1], device=DEV)
        qs = q.transpose(0, 1).unsqueeze(0)  # [1, H, 1, E]
        ref = F.scaled_dot_product_attention(qs.float(), ck.unsqueeze(0).float(), cv.unsqueeze(0).float(),
                                             enable_gqa=True)[0, :, 0]
        base = {"kind": "decode", "context": S, "H": H, "K": K, "E": E}
        nbytes = 2 * K * S * E * 2
        us = device_ms(lambda: F.scaled_dot_product_attention(qs, ck.unsqueeze(0), cv.unsqueeze(0),
                                                              enable_gqa=True)) * 1e3
        rows.append({**base, "variant": "sdpa", "us": us})
        out = torch.empty_like(q)
        produce = qkv_producer(S, H, K, E) if step else None
        for cfg, sl in (variants or _decode_grid(S)):
            if time.time() - T0 > budget_s:
                continue
            row = {**base, "variant": "triton", "config": cfg, "split_len": sl}
            call = lambda c=ck, v=cv, qq=q: decode_attention_fwd(qq, c, v, pos, out=out,  # noqa: E731
                                                                 split_len=sl, config=cfg and dict(cfg))
            try:
                out.fill_(float("nan"))
                call()
                err = rel_err(out[0], ref)
                if not err < 1e-2:
                    rows.append({**row, "rel_err": err, "error": "wrong output"})
                    continue
                t = device_ms(call) * 1e3
                it = iter(range(10**9))
                t_cold = device_ms(lambda: call(*caches[next(it) % n_cold]), reps=4 * n_cold) * 1e3
                rows.append({**row, "rel_err": err, "us": t, "us_cold": t_cold,
                             "tb_s": nbytes / (t * 1e-6) / 1e12, "tb_s_cold": nbytes / (t_cold * 1e-6) / 1e12})
                if step:
                    rows[-1].update(step_times(produce, call, q, caches, pos))
            except Exception as e:
                rows.append({**row, "error": repr(e)[:300]})
        # race check: the fastest fused variant on 30 fresh queries and positions
        fused_rows = [r for r in rows if r["kind"] == "decode" and r["context"] == S and r["variant"] == "triton"
                      and "us" in r and (r["config"] or {}).get("FUSED", r["config"] is None)]
        if fused_rows:
            best = min(fused_rows, key=lambda r: r["us"])
            worst = 0.0
            for i in range(30):
                qi = torch.randn(1, H, E, device=DEV, dtype=DTYPE)
                p = int(torch.randint(0, S, (1,)))
                pi = torch.tensor([p], device=DEV)
                refi = F.scaled_dot_product_attention(qi.transpose(0, 1).unsqueeze(0).float(),
                                                      ck[:, :p + 1].unsqueeze(0).float(),
                                                      cv[:, :p + 1].unsqueeze(0).float(), enable_gqa=True)[0, :, 0]
                for _ in range(3):
                    worst = max(worst, rel_err(decode_attention_fwd(qi, ck, cv, pi, split_len=best["split_len"],
                                                                    config=best["config"])[0], refi))
            rows.append({**base, "variant": "race_check", "config": best["config"], "split_len": best["split_len"],
                         "runs": 90, "max_rel_err": worst})
        print(f"decode {S} done at {time.time() - T0:.0f}s", flush=True)


def step_times(produce, call, q, caches, pos) -> dict:
    """µs that `call` adds behind `produce` (hot: the same cache; cold: rotating over the copies). The producer
    writes a q of its own and the slot at pos, which is put back afterwards."""
    n = len(caches)
    times = {}
    q = torch.empty_like(q)
    slots = [(c[:, pos].clone(), v[:, pos].clone()) for c, v in caches]
    for name, pick in (("step_us", lambda i: caches[0]), ("step_us_cold", lambda i: caches[i % n])):
        it, it2 = iter(range(10**9)), iter(range(10**9))
        reps = 20 if name == "step_us" else 4 * n
        alone = device_ms(lambda: produce(q, *pick(next(it)), pos), reps=reps)

        def pair():
            c = pick(next(it2))
            produce(q, *c, pos)
            call(*c, q)
        times[name] = (device_ms(pair, reps=reps, launches=2) - alone) * 1e3
        times[name.replace("us", "producer_us")] = alone * 1e3
    for (c, v), (sc, sv) in zip(caches, slots):
        c[:, pos], v[:, pos] = sc, sv
    return times


def defaults_check(rows, budget_s):
    """The launchers' own defaults (config=None) at the bench's shapes, and the decode variants left open by the
    first sweep: the fused combine (scalar ticket) against the separate kernel, and 16 splits at 32k."""
    for S in (2048, 8192):
        flash_sweep(rows, budget_s, S=S, configs=[None])
    for S in (1024, 8192, 32768):
        extra = [(None, None)] + [(dict(FUSED=f), None) for f in (False, True)]
        if S == 32768:
            extra += [(dict(FUSED=f), 2048) for f in (False, True)]
        decode_sweep(rows, budget_s, contexts=(S,), variants=extra)


def table(rows) -> str:
    lines = []
    for key in sorted({(r["S"], r["H"], r["E"]) for r in rows if r["kind"] == "flash"}):
        sub = [r for r in rows if r["kind"] == "flash" and (r["S"], r["H"], r["E"]) == key]
        sd = [r for r in sub if r["variant"] in ("sdpa_default", "sdpa_flash") and "ms" in r]
        best_sdpa = min((r["ms"] for r in sd), default=float("nan"))
        lines.append(f"flash S={key[0]} H={key[1]} E={key[2]}: " + ", ".join(
            f"{r['variant']} {r['ms'] * 1e3:.0f}us" if "ms" in r else f"{r['variant']} n/a" for r in sub
            if r["variant"].startswith("sdpa")))
        ok = sorted((r for r in sub if r["variant"] == "flash" and "ms" in r), key=lambda r: r["ms"])
        for r in ok[:8]:
            c = r["config"]
            name = "defaults" if c is None else (f"{c['BLOCK_M']}x{c['BLOCK_N']} w{c['num_warps']} "
                                                 f"s{c['num_stages']} desc={int(c['USE_DESC'])}")
            lines.append(f"  {name}: {r['ms'] * 1e3:.0f}us {r['tflop_s']:.0f}TF/s "
                         f"ratio {best_sdpa / r['ms']:.3f} err {r['rel_err']:.1e}")
        bad = [r for r in sub if r["variant"] == "flash" and "error" in r]
        lines += [f"  FAIL {r['config']}: {r['error'][:100]}" for r in bad]
    for S in sorted({r["context"] for r in rows if r["kind"] == "decode"}):
        sub = [r for r in rows if r["kind"] == "decode" and r["context"] == S]
        sd = next((r["us"] for r in sub if r["variant"] == "sdpa"), float("nan"))
        lines.append(f"decode {S}: sdpa {sd:.1f}us")
        ok = sorted((r for r in sub if r["variant"] == "triton" and "us" in r), key=lambda r: r["us"])
        for r in ok[:8]:
            lines.append(f"  split {r['split_len']} {r['config']}: {r['us']:.2f}us hot ({r['tb_s']:.2f}TB/s) "
                         f"{r['us_cold']:.2f}us cold ({r['tb_s_cold']:.2f}TB/s)" + (
                             f" step {r['step_us']:.2f} / {r['step_us_cold']:.2f}us cold" if "step_us" in r else ""))
        lines += [f"  race check {r['runs']} runs max rel err {r['max_rel_err']:.1e}" for r in sub
                  if r["variant"] == "race_check"]
        lines += [f"  PDL hand-off floor behind qkv_rope {r['step_us']:.2f}us" for r in sub
                  if r["variant"] == "handoff_floor"]
        lines += [f"  FAIL {r['config']} split {r['split_len']}: {r['error'][:100]}" for r in sub
                  if r["variant"] == "triton" and "error" in r][:5]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--budget-s", type=float, default=240)
    ap.add_argument("--only", default="decode,flash")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on CPU (TRITON_INTERPRET=1)")
    ap.add_argument("--defaults", action="store_true", help="only the launchers' defaults and open variants")
    ap.add_argument("--wide", action="store_true", help="the second sweep's grids (TMA, 256-slot blocks, T=2048 tiles)")
    ap.add_argument("--pdl", action="store_true", help="the third sweep: PDL and L2 prefetch, timed alone and "
                    "behind the decode step's qkv_rope (step)")
    ap.add_argument("--late", action="store_true", help="the fourth sweep: LATE_Q over block shapes, timed alone "
                    "and as the step")
    ap.add_argument("--contexts", default="1024,8192,32768", help="decode cache lengths")
    ap.add_argument("--flash-seqs", default="8192", help="flash sequence lengths")
    args = ap.parse_args()
    global DEV, DTYPE
    if args.cpu_smoke:
        DEV, DTYPE = "cpu", torch.float32
        meta = {"device": "cpu"}
        rows: list[dict] = []
        decode_sweep(rows, 1e9, contexts=(256,), H=8, K=2, E=64,
                     variants=[(None, None), (dict(FUSED=False), None), (dict(FUSED=True, PDL=True), 64),
                               (dict(PDL=True, LATE_Q=True), 64)], step=True)
        flash_sweep(rows, 1e9, S=96, shapes=((8, 64),), kv=2, smoke=True)
        print(table(rows))
        return
    meta = {"device": torch.cuda.get_device_name(), "date": datetime.datetime.utcnow().isoformat(timespec="seconds"),
            "torch": torch.__version__, "triton": triton.__version__}
    rows: list[dict] = []
    meta["read_tb_s_67MB"] = read_bandwidth(2 * 8 * 32768 * 64 * 2)
    meta["read_tb_s_1GB"] = read_bandwidth(2**30)
    path = os.path.join(args.out, "attn_sweep.json")
    try:
        contexts = tuple(int(c) for c in args.contexts.split(","))
        if args.defaults:
            defaults_check(rows, args.budget_s)
        elif "decode" in args.only:
            for S in contexts:
                grid = (_decode_grid_late(S) if args.late else _decode_grid_pdl(S) if args.pdl
                        else [(None, None)] + _decode_grid_wide(S) if args.wide else None)
                step = args.pdl or args.late
                decode_sweep(rows, args.budget_s * (0.6 if args.wide or step else 0.4), contexts=(S,), variants=grid,
                             step=step)
                if args.late:
                    handoff_floor(rows, S)
        if "flash" in args.only and not args.defaults:
            wide = [dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=st, USE_DESC=d)
                    for m, n, w, st, d in FLASH_SHORT]
            for S in (int(x) for x in args.flash_seqs.split(",")):
                flash_sweep(rows, args.budget_s, S=S, configs=[None] + wide if args.wide else None)
    finally:
        with open(path, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        print(meta)
        print(table(rows))


if __name__ == "__main__":
    main()
