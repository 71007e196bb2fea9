"""Numbers and parsing for the step debugger (tools/debug/stepper.py): slice text, fault injection, stats, diffs.

Pure functions on NumPy arrays; nothing here knows about engines or sessions.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from refimpl.compare import TOLERANCES, compare
from refimpl.errors import GenerationError

INJECTIONS = ("nan", "zero", "noise")


class CommandError(Exception):
    """A typed command is wrong; the session prints the one-line message and waits for the next one."""


def g(x: float) -> str:
    return f"{x:.7g}"


INT = re.compile(r"^[+-]?\d+$")


def parse_index(text: str) -> tuple:
    """'[0, :8]' -> (0, slice(None, 8)). Integers, slices and '...' only; never eval()."""
    t = text.strip()
    if not (t.startswith("[") and t.endswith("]")) or not t[1:-1].strip():
        raise CommandError(f"bad slice {text!r}: expected NumPy-style text like [0, :8] or [..., -1]")

    def num(bit: str):
        bit = bit.strip()
        if bit == "":
            return None
        if not INT.match(bit):
            raise CommandError(f"bad slice {text!r}: {bit!r} is not an integer")
        return int(bit)

    index = []
    for part in t[1:-1].split(","):
        part = part.strip()
        if part == "...":
            index.append(Ellipsis)
        elif ":" in part:
            bits = part.split(":")
            if len(bits) > 3:
                raise CommandError(f"bad slice {text!r}: {part!r} has more than two ':'")
            step = num(bits[2]) if len(bits) == 3 else None
            if step == 0:
                raise CommandError(f"bad slice {text!r}: slice step cannot be zero")
            index.append(slice(num(bits[0]), num(bits[1]), step))
        else:
            if not part:
                raise CommandError(f"bad slice {text!r}: empty index between commas")
            index.append(num(part))
    return tuple(index)


def parse_inject(spec: str, names: list[str]) -> tuple[str, str]:
    """'layers.0.attn.q=nan' -> ('layers.0.attn.q', 'nan'); bad text is a CLI error (GenerationError)."""
    name, sep, kind = spec.partition("=")
    if not sep or kind not in INJECTIONS:
        raise GenerationError(f"--inject {spec!r}: expected NAME=nan, NAME=zero or NAME=noise")
    if name not in names:
        raise GenerationError(f"--inject {spec!r}: {name!r} is not an activation name "
                              f"(e.g. {names[1]}; `list` in a session shows them all)")
    return name, kind


def injected(value: np.ndarray, kind: str) -> np.ndarray:
    """The fault: all NaN, all zero, or the value plus Gaussian noise of its own std (seed 0, repeatable)."""
    if kind == "nan":
        return np.full_like(value, np.nan)
    if kind == "zero":
        return np.zeros_like(value)
    noise = np.random.default_rng(0).standard_normal(value.shape).astype(np.float32)
    return (value + noise * np.float32(value.std())).astype(np.float32)


def stats_lines(label: str, name: str, value: np.ndarray, dtype: str) -> list[str]:
    """min/max/mean/std/norm over the finite values (float64 math), NaN/Inf counts, the first values."""
    v = value.astype(np.float64)
    finite = v[np.isfinite(v)]
    lines = [f"{name} [{label}] shape {list(value.shape)} {dtype}"]
    if finite.size:
        lines.append(f"  min {g(finite.min())}  max {g(finite.max())}  mean {g(finite.mean())}  "
                     f"std {g(finite.std())}  norm {g(np.sqrt(np.sum(finite * finite)))}")
    else:
        lines.append("  no finite values")
    first = " ".join(g(x) for x in value.reshape(-1)[:8])
    lines.append(f"  nan {int(np.isnan(v).sum())}  inf {int(np.isinf(v).sum())}  first [{first}]")
    return lines


@dataclass(frozen=True)
class Diff:
    max_abs: float
    nmse: float
    worst: tuple[int, ...]


def difference(a: np.ndarray, b: np.ndarray) -> Diff:
    """b against a, with refimpl.compare's metrics; NaN facing NaN (same place) counts as equal, any other
    non-finite mismatch as an infinite difference (lockstep after an injected NaN must not flag every op)."""
    if a.shape != b.shape:
        return Diff(float("inf"), float("inf"), ())
    a, b = a.astype(np.float64), b.astype(np.float64)
    same = (a == b) | (np.isnan(a) & np.isnan(b))
    a, b = np.where(same, 0.0, a), np.where(same, 0.0, b)
    bad = ~(np.isfinite(a) & np.isfinite(b))
    if bad.any():
        return Diff(float("inf"), float("inf"), tuple(int(i) for i in np.unravel_index(int(np.argmax(bad)),
                                                                                       a.shape)))
    c = compare("", b, a, TOLERANCES["fp32"])
    return Diff(c.max_abs, c.nmse, c.worst)


def softmax64(logits: np.ndarray) -> np.ndarray:
    """Probabilities in float64; NaN logits (an injected fault) give NaN probabilities, not a warning."""
    finite = logits[np.isfinite(logits)]
    z = logits.astype(np.float64) - (finite.max() if finite.size else 0.0)
    p = np.exp(z)
    return p / p.sum()
