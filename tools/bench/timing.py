"""Timing GPU work (device METHOD.md): CUDA events after warm-up, medians; no engine import, so sweep scripts
can use it on their own."""
from __future__ import annotations

import statistics

import torch


def require_cuda(script: str) -> None:
    """One error line, not a traceback, where a GPU-only benchmark starts without CUDA."""
    if not torch.cuda.is_available():
        raise SystemExit(f"error: {script} needs a CUDA GPU (torch.cuda.is_available() is False here)")


def median_ms(fn, reps: int = 10, warmup: int = 2) -> float:
    """Median over `reps` of fn's device time (CUDA events), after `warmup` untimed calls."""
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


def round_robin_ms(fns: dict, rounds: int = 9, around=None, spin_cycles: int = 0) -> dict:
    """{label: fn} called in turn, `rounds` times round-robin after one warm-up round -> {label: (median ms as
    called, CUDA events around one synced call; median ms the host took to queue it, no sync inside)}. Rows
    measured in turn share any drift of the host's speed, which sequential medians do not (NOTES.md: one build's
    prefill as called differed by 30% between processes). around(label): a context manager each call runs in.
    spin_cycles: each call queued behind a spin that long, the events from the spin's end (a head start: the
    host has queued the first launches by then, so as called minus this is what those launches cost)."""
    import contextlib
    import time
    times = {label: ([], []) for label in fns}
    for r in range(rounds + 1):
        for label, fn in fns.items():
            with around(label) if around else contextlib.nullcontext():
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                if spin_cycles:
                    torch.cuda._sleep(spin_cycles)
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
    host queues all `reps` calls, so the events between them see only the GPU's work. Median of 3.
    (Events around one eager call include the launch latency: 73 µs for a 3.4 µs decode-attention kernel, and
    +40 µs on a 70 µs flash-attention call, tools/bench/NOTES.md.)"""
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


def cuda_profile(fn, rows: int, host: bool = False):
    """fn() once under torch.profiler, CUDA activity only (with `host`, the CPU's calls too), synchronised -> (the
    top `rows` kernels by device time as torch's table, the key averages behind it)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA] + [ProfilerActivity.CPU] * host) as prof:
        fn()
        torch.cuda.synchronize()
    averages = prof.key_averages()
    return averages.table(sort_by="cuda_time_total", row_limit=rows), averages


def profile_decode_steps(engine, sess, logits, pos: int, steps: int, rows: int) -> str:
    """Per-kernel device time of `steps` greedy decode steps of an eager (uncaptured) engine after its prefill
    (`logits` at `pos` tokens), after 4 warm-up steps (compilation): totals divided by `steps` are per token."""
    engine.decode_greedy(sess, logits, pos, 4)
    torch.cuda.synchronize()
    return cuda_profile(lambda: engine.decode_greedy(sess, logits, pos, steps + 1), rows)[0]
