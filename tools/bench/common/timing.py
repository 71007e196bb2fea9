"""Timing on the GPU (CUDA events after warm-up, medians of repeats) and the device's ceilings."""
from __future__ import annotations

import statistics
import time

def median_ms(fn, reps: int = 10, warmup: int = 2) -> float:
    """Median over `reps` of fn's time as called (CUDA events around each call), after `warmup` untimed calls."""
    import torch
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def round_robin_ms(fns: dict, rounds: int = 9) -> dict:
    """{label: fn} called in turn, `rounds` times round-robin after one warm-up round -> {label: (median ms as
    called, CUDA events around one synced call; median ms the host took to queue it)}. Rows measured in turn share
    any drift of the host's speed, which sequential medians do not (one prefill as called differed by 30% between
    processes)."""
    import torch
    times = {label: ([], []) for label in fns}
    for r in range(rounds + 1):
        for label, fn in fns.items():
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t = time.perf_counter()
            fn()
            host = (time.perf_counter() - t) * 1e3
            end.record()
            end.synchronize()
            if r:
                times[label][0].append(start.elapsed_time(end))
                times[label][1].append(host)
    return {label: (statistics.median(c), statistics.median(h)) for label, (c, h) in times.items()}


def device_ms(fn, reps: int = 20, sleep_cycles: int = 40_000_000) -> float:
    """Device time of one fn() call, free of host launch cost: a ~20 ms spin kernel holds the stream while the
    host queues all `reps` calls, so the events between them see only the GPU's work. Median of 3. (Events around
    one eager call include the launch latency: 73 µs for a 3.4 µs decode-attention kernel.)"""
    import torch
    fn()  # outside the timing: cuBLAS handles, workspaces, Triton compilation
    torch.cuda.synchronize()
    times = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(sleep_cycles)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / reps)
    return sorted(times)[1]


def graph_us(calls, reps: int = 10, capture_error_mode: str = "global") -> float:
    """µs a call of `calls` captured in one CUDA graph (one call per weight copy: with >= 256 MB of copies the
    weights leave the L2 as a decode step's layers do), replayed `reps` times; the median, the graph's gaps
    between kernels included as in decode. capture_error_mode: torch.cuda.graph's ("thread_local" for NCCL
    collectives)."""
    import torch
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up: compilation outside the capture
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, capture_error_mode=capture_error_mode):
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


def allreduce_us(split, D: int, layers: int, device) -> float:
    """µs an all-reduce of a [1, D] bf16 row (split.reduce: the decode step's) takes inside a CUDA graph of
    2·layers of them."""
    import torch
    x = torch.randn(1, D, device=device, dtype=torch.bfloat16)
    calls = [lambda: split.reduce(x)] * (2 * layers)
    return graph_us(calls, capture_error_mode="thread_local")


def cuda_profile(fn, rows: int):
    """fn() once under torch.profiler (CUDA activity), synchronised -> the top `rows` kernels by device time."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows)


def profile_decode_steps(engine, sess, logits, pos: int, steps: int, rows: int) -> str:
    """Per-kernel device time of `steps` greedy decode steps of an eager (uncaptured) engine after its prefill
    (`logits` at `pos` tokens), after 4 warm-up steps (compilation): totals divided by `steps` are per token."""
    import torch
    engine.decode_greedy(sess, logits, pos, 4)
    torch.cuda.synchronize()
    return cuda_profile(lambda: engine.decode_greedy(sess, logits, pos, steps + 1), rows)


# ---- the device's ceilings ----

def copy_bandwidth(device, nbytes: int = 2**31, trials: int = 5) -> float:
    """Device-to-device copy, bytes read + written per second (TB/s), on a 2 GiB random buffer (>> the L2): the best
    of `trials` medians of 10 copies, each trial on buffers of its own. A single median has read 15% low minutes
    apart on the same GPU (a low reading raises every % of a roofline built on it); the best is what the memory
    reaches. The buffers are returned to the GPU after (the KV pools are sized from its free memory)."""
    import torch
    best = float("inf")
    for _ in range(trials):
        src = torch.randn(nbytes // 2, device=device, dtype=torch.bfloat16)
        dst = torch.empty_like(src)
        best = min(best, median_ms(lambda: dst.copy_(src), reps=10, warmup=3))
        del src, dst
        torch.cuda.empty_cache()
    return 2 * nbytes / (best * 1e-3) / 1e12


def gemm_tflops(device, n: int = 8192) -> float:
    """bf16 n×n×n matrix product rate (TFLOP/s)."""
    import torch
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    ms = median_ms(lambda: a @ b, reps=20, warmup=3)
    return 2 * n**3 / (ms * 1e-3) / 1e12
