"""Start-up benchmark: seconds from launching `llama32 generate` to its first token on stdout.

    python -m tools.bench.startup [--runs 5] [--json-out out.json] [-- extra generate args]

Each run is a fresh process (`python -m tools.cli generate --max-new-tokens 1 ...`, the default model unless
--model is passed through), timed from just before the spawn to the first byte it writes to stdout; its CPU time
(user + system, all threads) comes from the kernel's accounting of children. One untimed run first warms the page
cache, so this measures a warm start. The machine's 1-minute load average is recorded before and after: on a busy
machine the wall time grows with the load while the CPU time does not. A benchmark, not a test: it asserts nothing.
"""
from __future__ import annotations

import os
import resource
import statistics
import subprocess
import sys
import time

from tools.bench import common

PROMPT = "What is the capital of France?"


def one_run(argv: list[str]) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = proc.stdout.read(1)
    t_first = time.perf_counter() - t0
    proc.stdout.read()
    proc.wait()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if proc.returncode != 0 or not first:
        raise SystemExit(f"generate failed (exit {proc.returncode}): {proc.stderr.read().decode()[-500:]}")
    return {"first_token_s": t_first, "exit_s": time.perf_counter() - t0, "cpu_s": cpu}


def main(argv=None) -> int:
    ap = common.parser("tools.bench.startup", __doc__)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("extra", nargs="*", help="more `llama32 generate` arguments (after --)")
    args = ap.parse_args(argv)
    cmd = [sys.executable, "-m", "tools.cli", "generate", "--max-new-tokens", "1", *args.extra, PROMPT]
    one_run(cmd)  # warm the page cache
    load_before = os.getloadavg()[0]
    runs = [one_run(cmd) for _ in range(args.runs)]
    record = common.record("cpu", generate=cmd[1:], cpus=len(os.sched_getaffinity(0)), **{
              "load_avg_1min_before": load_before, "load_avg_1min_after": os.getloadavg()[0], "runs": runs,
              "median_first_token_s": statistics.median(r["first_token_s"] for r in runs),
              "min_first_token_s": min(r["first_token_s"] for r in runs),
              "median_cpu_s": statistics.median(r["cpu_s"] for r in runs)})
    print(f"{' '.join(cmd[1:])}: {args.runs} warm starts on {record['cpus']} CPUs "
          f"(1-min load {load_before:.1f} -> {record['load_avg_1min_after']:.1f})")
    print(f"{'run':>4}{'first token s':>15}{'exit s':>9}{'cpu s':>8}")
    for i, r in enumerate(runs):
        print(f"{i:>4}{r['first_token_s']:>15.2f}{r['exit_s']:>9.2f}{r['cpu_s']:>8.2f}")
    print(f"median first token {record['median_first_token_s']:.2f} s (min {record['min_first_token_s']:.2f}), "
          f"median CPU {record['median_cpu_s']:.2f} s")
    common.write_record(args.json_out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
