"""`GET /metrics` in Prometheus' text exposition format (version 0.0.4), with vLLM's metric names where one
exists, so a dashboard made for vLLM reads these too."""
from __future__ import annotations

import bisect
import threading
import time

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0)


class Histogram:
    def __init__(self, name: str, help: str, buckets=LATENCY_BUCKETS):
        self.name, self.help, self.buckets = name, help, tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # the last: +Inf
        self.sum, self.count = 0.0, 0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self._lock:
            self.counts[bisect.bisect_left(self.buckets, value)] += 1
            self.sum += value
            self.count += 1

    def lines(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        with self._lock:
            total = 0
            for le, n in zip(self.buckets, self.counts):
                total += n
                out.append(f'{self.name}_bucket{{le="{le}"}} {total}')
            out += [f'{self.name}_bucket{{le="+Inf"}} {self.count}', f"{self.name}_sum {self.sum}",
                    f"{self.name}_count {self.count}"]
        return out


class Metrics:
    def __init__(self):
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time from arrival to the first token.")
        self.tpot = Histogram("vllm:time_per_output_token_seconds", "Time between output tokens of a request.")
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Time from arrival to the last token.")
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.requests = {"stop": 0, "length": 0, "abort": 0, "error": 0}
        self._lock = threading.Lock()

    def finished(self, outcome: str | None, prompt_tokens: int, choices, arrived: float) -> None:
        """A response is over: `outcome` "abort" / "error", or None for each choice's own finish reason."""
        self.e2e.observe(time.perf_counter() - arrived)
        with self._lock:
            for c in choices:
                reason = outcome or c.finish_reason or "abort"
                self.requests[reason] = self.requests.get(reason, 0) + 1
                self.generation_tokens += c.tokens
            self.prompt_tokens += prompt_tokens

    def render(self, stats: dict) -> str:
        gauges = [
            ("vllm:num_requests_running", "Requests in the running batch.", stats.get("running", 0)),
            ("vllm:num_requests_waiting", "Requests waiting to be scheduled.", stats.get("waiting", 0)),
            ("llama32:kv_blocks_used", "KV-cache blocks in use.", stats.get("blocks_used", 0)),
            ("llama32:kv_blocks_free", "KV-cache blocks free.", stats.get("blocks_free", 0)),
        ]
        used, free = stats.get("blocks_used", 0), stats.get("blocks_free", 0)
        gauges.append(("vllm:gpu_cache_usage_perc", "Fraction of KV-cache blocks in use.",
                       used / (used + free) if used + free else 0.0))
        lines = scalar_lines("gauge", gauges)
        with self._lock:
            counters = [("vllm:prompt_tokens_total", "Prompt tokens processed.", self.prompt_tokens),
                        ("vllm:generation_tokens_total", "Tokens generated.", self.generation_tokens),
                        ("vllm:num_preemptions_total", "Sequences preempted (recomputed later).",
                         stats.get("num_preemptions", 0))]
            requests = dict(self.requests)
        lines += scalar_lines("counter", counters)
        lines += ["# HELP vllm:request_success_total Finished requests by finish reason.",
                  "# TYPE vllm:request_success_total counter"]
        lines += [f'vllm:request_success_total{{finished_reason="{k}"}} {v}' for k, v in sorted(requests.items())]
        for h in (self.ttft, self.tpot, self.e2e):
            lines += h.lines()
        return "\n".join(lines) + "\n"


def scalar_lines(kind: str, rows) -> list[str]:
    """(name, help, value) rows of one metric type (gauge, counter) -> their exposition lines."""
    lines = []
    for name, help, value in rows:
        lines += [f"# HELP {name} {help}", f"# TYPE {name} {kind}", f"{name} {value}"]
    return lines
