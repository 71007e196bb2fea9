"""A minimal progress bar for long loads: silent for the first second, and only on a terminal.

refimpl depends on numpy, safetensors, tokenizers and jinja2 alone, so this is ten lines rather than a library.
"""
from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, label: str, total: int, stream=None, delay_s: float = 1.0):
        self.label, self.total, self.done = label, max(total, 1), 0
        self.stream = stream or sys.stderr
        self.start, self.delay_s, self.shown = time.perf_counter(), delay_s, False

    def advance(self, n: int = 1, info: str = "") -> None:
        """Count n more items done; `info` (e.g. "loss 1.23") is shown after the bar."""
        self.done += n
        elapsed = time.perf_counter() - self.start
        if elapsed >= self.delay_s and self.stream.isatty():
            width = 30
            filled = int(width * self.done / self.total)
            self.stream.write(f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] "
                              f"{self.done}/{self.total} {elapsed:.1f}s{' ' + info if info else ''}")
            self.stream.flush()
            self.shown = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.shown:
            self.stream.write("\n")
            self.stream.flush()
