"""Comparing two activations: the metrics every report uses (golden check, diff, step debugger).

    max_abs   max |a − b|
    nmse      Σ(a − b)² / Σb²  (normalized mean squared error; llama.cpp grades < 1e-4 "excellent", < 1e-2 "good")
    worst     index of the max |a − b|

Tolerances are per dtype of the compared run; an activation passes when both its NMSE and its max abs error
(relative to the reference's largest magnitude) are within them:
    fp32  nmse 1e-9, max_rel 1e-4  fp32 kernels differ from NumPy only in summation order and fused
                                    multiply-adds: ~1e-7 relative per op, grown by depth to ~1e-6 here.
    bf16  nmse 1e-3, max_rel 6e-2  bf16 keeps 8 mantissa bits (relative rounding 2^-9 ≈ 2e-3 per value); a
                                    layer rounds several times and errors compound across layers, so NMSE
                                    ~1e-4 is typical and 1e-3 still means a correct model; max_rel allows the
                                    rare value where rounding of a large intermediate lands on it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Tolerance:
    nmse: float
    max_rel: float


TOLERANCES = {"fp32": Tolerance(nmse=1e-9, max_rel=1e-4), "bf16": Tolerance(nmse=1e-3, max_rel=6e-2)}


@dataclass(frozen=True)
class Comparison:
    name: str
    shape: tuple[int, ...]
    max_abs: float
    nmse: float
    worst: tuple[int, ...]
    ref_max: float
    ok: bool
    problem: str = ""  # shape mismatch, NaN, ... when the numbers cannot be compared

    @property
    def max_rel(self) -> float:
        return self.max_abs / self.ref_max if self.ref_max > 0 else self.max_abs


def compare(name: str, got, ref, tol: Tolerance) -> Comparison:
    """Compare `got` against the reference `ref` (both array-likes; NumPy float64 math)."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    if got.shape != ref.shape:
        return Comparison(name, tuple(ref.shape), float("inf"), float("inf"), (), 0.0, False,
                          f"shape {list(got.shape)} != reference {list(ref.shape)}")
    if got.size == 0:
        return Comparison(name, got.shape, 0.0, 0.0, (), 0.0, True)
    diff = np.abs(got - ref)
    if not np.isfinite(got).all():
        bad = np.unravel_index(int(np.argmax(~np.isfinite(got))), got.shape)
        return Comparison(name, got.shape, float("inf"), float("inf"), tuple(int(i) for i in bad),
                          float(np.abs(ref).max()), False, "NaN/Inf")
    worst = np.unravel_index(int(np.argmax(diff)), diff.shape)
    denom = float(np.sum(ref * ref))
    nmse = float(np.sum(diff * diff) / denom) if denom > 0 else float(np.sum(diff * diff))
    max_abs, ref_max = float(diff[worst]), float(np.abs(ref).max())
    ok = nmse <= tol.nmse and max_abs <= tol.max_rel * max(ref_max, 1e-30)
    return Comparison(name, got.shape, max_abs, nmse, tuple(int(i) for i in worst), ref_max, ok)
