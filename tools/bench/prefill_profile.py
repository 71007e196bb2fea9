"""Where a prefill's time goes, as called: kernels, the GPU's idle gaps between them, and the SM clock.

    python3 -m tools.bench.prefill_profile [--out DIR] [--models 3b] [--tokens 2048] [--quant int8 --path dequant]

For each model (random bf16 weights at the real shapes): the per-kernel device-time table of one prefill; then one
prefill traced with CPU and CUDA activities, from which the GPU's busy time, its idle gaps (the largest listed with
the kernels around them) and when the host issued its last launch; then the as-called time (CUDA events around one
eager call, tools.bench.gpu.prefill_ms) beside the GPU time alone (queued behind a spin), each while nvidia-smi
samples the SM clock and power; the host's own time to queue one prefill (no sync inside), and a cProfile of it.
--quant runs the same on the weights quantized on the device, through --path (accel.quant_ops.prefill_path).
--variants also times each of accel.model.PrefillOptions' variants in turn in the same process (`variant_times`):
as called, with a head start (the same call queued behind a short spin, events from the spin's end: the GPU never
waits for the host, so as called minus this is what the host's first launches cost), and GPU time alone.
Prints a summary; writes DIR/prefill_profile.json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from accel.engine import AccelEngine
from accel.model import prefill_options
from accel.quant_layers import quantize_weights
from accel.quant_ops import prefill_path
from accel.weights import random_weights
from refimpl.model.config import PRESETS
from refimpl.quant.schemes import QuantSpec
from tools.bench.gpu import profile_prefill, prompt_ids
from tools.bench.timing import device_ms, median_ms, round_robin_ms

NAMES = {"1b": "llama-3.2-1b", "3b": "llama-3.2-3b"}


def _sampled(fn) -> tuple[object, dict]:
    """fn()'s result and nvidia-smi's SM clock (MHz) and power (W) sampled every 10 ms meanwhile (empty when
    nvidia-smi is missing), with the clock event (throttle) reason bitmasks seen and how often."""
    try:
        smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                                "-lms", "10"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        why = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks_throttle_reasons.active", "--format=csv,noheader",
                                "-lms", "10"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    except FileNotFoundError:
        return fn(), {}
    try:
        out = fn()
    finally:
        smi.terminate()
        why.terminate()
    reasons: dict[str, int] = {}
    for line in why.communicate(timeout=10)[0].splitlines():
        if line.strip().startswith("0x"):
            reasons[line.strip()] = reasons.get(line.strip(), 0) + 1
    samples = []
    for line in smi.communicate(timeout=10)[0].splitlines():
        try:
            clk, watts = (float(v) for v in line.split(","))
            samples.append((clk, watts))
        except ValueError:
            continue
    if not samples:
        return out, {}
    clocks, power = [c for c, _ in samples], [w for _, w in samples]
    return out, {"samples": len(samples), "sm_mhz_median": statistics.median(clocks), "sm_mhz_min": min(clocks),
                 "power_w_median": statistics.median(power), "power_w_max": max(power), "reasons": reasons}


def timeline(fn) -> dict:
    """One prefill, fn(), traced: GPU busy time, idle gaps, and the host's last launch, from the Chrome trace."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        name = f.name
    prof.export_chrome_trace(name)
    with open(name) as f:
        events = json.load(f)["traceEvents"]
    os.unlink(name)
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    memsets = sorted((e for e in events if e.get("cat") == "gpu_memset"), key=lambda e: e["ts"])
    launches = [e for e in events if e.get("cat") == "cuda_runtime" and "Launch" in e.get("name", "")]
    if not kernels:
        return {}
    start, end = kernels[0]["ts"], max(e["ts"] + e["dur"] for e in kernels)
    gaps = []
    for a, b in zip(kernels, kernels[1:]):
        gap = b["ts"] - (a["ts"] + a["dur"])
        if gap > 0:
            gaps.append((gap, a["name"][:60], b["name"][:60], a["ts"] - start))
    gaps.sort(reverse=True)
    first_launch = min((e["ts"] for e in launches), default=start)
    totals: dict[str, list] = {}
    for e in kernels:
        t = totals.setdefault(e["name"][:60], [0.0, 0])
        t[0] += e["dur"]
        t[1] += 1
    top = sorted(totals.items(), key=lambda kv: -kv[1][0])[:12]
    around: dict[str, int] = {}  # the kernel that follows each device memset: whose workspace it clears
    for m in memsets:
        after = next((k["name"][:60] for k in kernels if k["ts"] >= m["ts"]), "(none)")
        around[after] = around.get(after, 0) + 1
    return {"kernels": len(kernels), "launches": len(launches), "gpu_span_ms": (end - start) / 1e3,
            "gpu_busy_ms": sum(e["dur"] for e in kernels) / 1e3, "idle_ms": sum(g[0] for g in gaps) / 1e3,
            "idle_gaps_over_5us": sum(1 for g in gaps if g[0] > 5),
            "host_first_launch_to_first_kernel_us": start - first_launch,
            "host_last_launch_ms": (max((e["ts"] for e in launches), default=start) - first_launch) / 1e3,
            "kernel_totals_us": [{"name": n, "us": us, "calls": c} for n, (us, c) in top],
            "memsets": len(memsets), "memset_us": sum(e["dur"] for e in memsets),
            "kernel_after_memset": around,
            "largest_gaps_us": [{"us": g, "after": a, "before": b, "at_ms": t / 1e3} for g, a, b, t in gaps[:12]]}


def host_queue(fn, reps: int = 10) -> tuple[float, str]:
    """(median ms the host takes to queue fn()'s work, measured without syncing inside; the cProfile of one call,
    top functions by own time)."""
    import cProfile
    import io
    import pstats
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(18)
    return statistics.median(times), text.getvalue()


def model_profile(model: str, tokens: int, quant: str | None = None, path: str | None = None,
                  variants: bool = False) -> dict:
    cfg = PRESETS[NAMES[model]]
    weights = random_weights(cfg, "cuda", torch.bfloat16)
    if quant:
        weights = quantize_weights(weights, QuantSpec.parse(quant))
    table = profile_prefill(cfg, "cuda", tokens, rows=25) if not quant else ""
    engine = AccelEngine(cfg, weights, torch.device("cuda"), "bf16", use_graph=False)
    prompt = torch.tensor(prompt_ids(cfg, tokens, seed=1), device="cuda")
    sess = engine.session(tokens)
    with prefill_path(path):
        row = _measure(engine, prompt, sess, {"model": model, "quant": quant or "bf16", "path": path,
                                              "tokens": tokens, "profile": table})
        if variants:
            row["variants"] = variant_times(lambda: engine.prefill(prompt, sess))
        return row


def _measure(engine, prompt, sess, row: dict) -> dict:
    fn = lambda: engine.prefill(prompt, sess)  # noqa: E731
    fn()
    row["timeline"] = timeline(fn)
    row["host_queue_ms"], row["host_cprofile"] = host_queue(fn)
    row["as_called_ms"], row["as_called_clock"] = _sampled(lambda: median_ms(fn, reps=20, warmup=2))
    row["head_start_ms"] = head_start_ms(fn)
    row["gpu_ms"], row["gpu_clock"] = _sampled(lambda: device_ms(fn, reps=3, sleep_cycles=100_000_000))
    spaced = []  # one call after 50 ms of host sleep each: the GPU idles between calls, as between a user's requests
    for _ in range(10):
        time.sleep(0.05)
        spaced.append(median_ms(fn, reps=1, warmup=0))
    row["after_idle_ms"] = statistics.median(spaced)
    return row


VARIANTS = {"default (PDL, last row, residual add in the GEMMs)": {},
            "residual add in the norm's pass": dict(residual_in_gemm=False),
            "before: no PDL, all rows, add in the norm": dict(pdl=False, last_row=False, residual_in_gemm=False)}
HEAD_START_CYCLES = 4_000_000  # ~2 ms: longer than the host takes to queue a prefill's first launches


def head_start_ms(fn, reps: int = 10) -> float:
    """Median ms of fn() queued behind a ~2 ms spin, CUDA events from the spin's end (timing.round_robin_ms)."""
    return round_robin_ms({"": fn}, reps, spin_cycles=HEAD_START_CYCLES)[""][0]


def variant_times(fn, rounds: int = 15) -> dict:
    """Each VARIANTS entry called in turn (timing.round_robin_ms), as called and with a head start -> {label:
    {as_called_ms, host_ms (the host's time to queue it), head_start_ms (medians), gpu_ms (device_ms), and from
    one traced call gpu_busy_ms, memsets, kernel_totals_us}}."""
    fns = {label: fn for label in VARIANTS}
    around = lambda label: prefill_options(**VARIANTS[label])  # noqa: E731
    called = round_robin_ms(fns, rounds, around)
    ahead = round_robin_ms(fns, rounds, around, spin_cycles=HEAD_START_CYCLES)
    out = {}
    for label, kw in VARIANTS.items():
        with prefill_options(**kw):
            gpu = device_ms(fn, reps=3, sleep_cycles=100_000_000)
            trace = timeline(fn)
        out[label] = {"as_called_ms": called[label][0], "host_ms": called[label][1], "head_start_ms": ahead[label][0],
                      "gpu_ms": gpu, **{k: trace.get(k) for k in ("gpu_busy_ms", "memsets", "kernel_totals_us")}}
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--models", default="3b")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--quant", default=None, help="a --quant format: profile the quantized engine")
    ap.add_argument("--path", default=None, choices=["gemm", "dequant"], help="the quantized prefill path")
    ap.add_argument("--variants", action="store_true", help="also time accel.model.PrefillOptions' variants")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # a timeout still writes what was measured
    res = {"meta": {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}, "rows": []}
    try:
        for m in args.models.split(","):
            res["rows"].append(model_profile(m, args.tokens, args.quant, args.path, args.variants))
            r = res["rows"][-1]
            print(r["profile"] + r["host_cprofile"])
            print(json.dumps({k: v for k, v in r.items() if k not in ("profile", "host_cprofile")}, indent=1),
                  flush=True)
            for label, v in r.get("variants", {}).items():
                print(f"{m} {label:50s} as called {v['as_called_ms']:7.3f}  host {v['host_ms']:7.3f}  head start "
                      f"{v['head_start_ms']:7.3f}  GPU {v['gpu_ms']:7.3f}  busy {v['gpu_busy_ms'] or 0:7.3f} ms  "
                      f"memsets {v['memsets']}", flush=True)
    finally:
        name = f"prefill_profile_{args.models}" + (f"_{args.quant}_{args.path}" if args.quant else "")
        with open(os.path.join(args.out, name.replace(":", "-").replace(",", "_") + ".json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
