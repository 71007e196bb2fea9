"""Timing GPU work (device METHOD.md): CUDA events after warm-up, medians; no engine import, so sweep scripts
can use it on their own."""
from __future__ import annotations

import statistics

import torch


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
