"""A minimal progress bar for long loads: silent for the first second, and only on a terminal; for long work that
must show progress wherever its stderr goes (training, calibrated quantization), plain lines elsewhere (`lines_s`).

refimpl depends on numpy, safetensors, tokenizers and jinja2 alone, so this is ten lines rather than a library.
"""
from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, label: str, total: int, stream=None, delay_s: float = 1.0, lines_s: float | None = None):
        """lines_s: off a terminal, write a plain line for the first item, then at most one every lines_s seconds,
        and one for the last (None: nothing off a terminal)."""
        self.label, self.total, self.done = label, max(total, 1), 0
        self.stream = stream or sys.stderr
        self.start, self.delay_s, self.shown = time.perf_counter(), delay_s, False
        self.lines_s, self.last_line = lines_s, None

    def advance(self, n: int = 1, info: str = "") -> None:
        """Count n more items done; `info` (e.g. "loss 1.23") is shown after the bar."""
        self.done += n
        elapsed = time.perf_counter() - self.start
        terminal = self.stream.isatty()
        if not terminal and self.lines_s is not None:
            if self.last_line is None or elapsed - self.last_line >= self.lines_s or self.done >= self.total:
                self.stream.write(f"{self.label}: {self.done}/{self.total} {elapsed:.1f}s{' ' + info if info else ''}\n")
                self.stream.flush()
                self.last_line = elapsed
            return
        if elapsed >= self.delay_s and terminal:
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
