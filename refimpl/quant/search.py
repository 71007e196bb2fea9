"""Error-minimizing scales (and minima) for the int8 / int4 formats: the same codes and layout as
refimpl.quant.schemes, only better (scale, minimum) pairs than the min/max range.

Min/max spends the code range on the extreme values; one outlier stretches the step for the whole row or group.
Here each row (int8) or group (int4) tries a few candidate ranges and keeps the one with the smallest weighted
squared error  Σ_k a[k] · (w[k] − ŵ[k])²  of its dequantized values ŵ, all with bf16-rounded parameters and the
nearest codes (the format's own `int8_codes` / `int4_codes`), so the error minimized is the one the engines see.

    int8   s = bf16(r · max|w| / 127) for the shrink ratios r in RATIOS_INT8
    int4   as llama.cpp's make_qkx2_quants: for each candidate inverse step (15 + δ) / (max − min), δ in DELTAS_INT4,
           codes l = clip(rint((w − min) · step⁻¹), 0, 15), then the weighted least-squares (s, m) for those codes
           (the 2×2 normal equations of ŵ = s·l + m); plus min/max itself, so it is never worse than round-to-nearest.

a [K] is the importance of each input column: 1 without calibration, or E[x_k²] over calibration activations
(llama.cpp's importance matrix, the diagonal of the layer's Hessian X^T X / T): an error in a column the inputs
rarely excite costs little. [N, K] = [Dout, Din], G the group size, as in refimpl.quant.schemes.
"""
from __future__ import annotations

import numpy as np

from refimpl.quant.schemes import F32, QuantizedLinear, int4_codes, int4_groups, int4_linear, int8_codes, round_bf16

RATIOS_INT8 = np.linspace(0.5, 1.0, 51)  # step 0.01: past 1/2 of max|w| clipping costs more than it saves
DELTAS_INT4 = np.linspace(-1.0, 1.0, 21)  # llama.cpp's rmin = -1, rdelta = 0.1, nstep = 20


def importance_of(h: np.ndarray) -> np.ndarray:
    """A layer's calibration Hessian Σ xᵀx [K, K] -> column importance [K] (its diagonal, scaled to max 1)."""
    d = np.diag(h)
    return (d / max(float(d.max()), 1e-30)).astype(F32)


def _importance(a: np.ndarray | None, K: int) -> np.ndarray:
    return np.ones(K, F32) if a is None else np.asarray(a, F32)


# ---------------------------------------------------------------- int8, one scale a row

def int8_error(w: np.ndarray, scale: np.ndarray, a: np.ndarray) -> np.ndarray:
    """w [N, K], scale [N, 1], a [K] -> [N]: the weighted squared error of each row's nearest codes."""
    r = w - int8_codes(w, scale).astype(F32) * scale  # [N, K]
    return (r * r) @ a  # [N, K] @ [K] -> [N]


def search_int8_scales(w: np.ndarray, a: np.ndarray | None = None) -> np.ndarray:
    """w [N, K] -> bf16 scales [N, 1] minimizing each row's weighted error over the shrink ratios."""
    w = np.asarray(w, F32)
    a = _importance(a, w.shape[1])
    amax = np.abs(w).max(axis=1, keepdims=True)  # [N, 1]
    best = round_bf16(amax / F32(127))  # ratio 1: min/max
    best_err = int8_error(w, best, a)
    for ratio in RATIOS_INT8[:-1]:
        scale = round_bf16(amax * F32(ratio) / F32(127))
        err = int8_error(w, scale, a)
        better = err < best_err  # [N]
        best = np.where(better[:, None], scale, best)
        best_err = np.where(better, err, best_err)
    return best


def quantize_int8_search(w: np.ndarray, a: np.ndarray | None = None) -> QuantizedLinear:
    w = np.asarray(w, F32)  # [N, K]
    scale = search_int8_scales(w, a)
    return QuantizedLinear("int8", w.shape, int8_codes(w, scale), scale, None, w.shape[1])


# ---------------------------------------------------------------- int4, a scale and a minimum a group

def int4_error(g: np.ndarray, scale: np.ndarray, low: np.ndarray, a: np.ndarray) -> np.ndarray:
    """g [..., G], scale/low [...], a [G] (or broadcastable to g) -> [...]: weighted squared error."""
    r = g - (int4_codes(g, scale, low).astype(F32) * scale[..., None] + low[..., None])  # [..., G]
    return (r * r * a).sum(axis=-1)


def _least_squares(g: np.ndarray, codes: np.ndarray, a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The weighted least-squares s, m of g ≈ s·codes + m per group: g, codes [..., G], a [..., G] -> [...] each."""
    l = codes.astype(F32)
    sw, sl, sll = a.sum(-1), (a * l).sum(-1), (a * l * l).sum(-1)
    sx, slx = (a * g).sum(-1), (a * l * g).sum(-1)
    det = sw * sll - sl * sl  # 0 when every code in the group is equal
    safe = np.where(det > 0, det, F32(1))
    s = np.where(det > 0, (sw * slx - sl * sx) / safe, F32(0))
    m = np.where(det > 0, (sll * sx - sl * slx) / safe, sx / np.maximum(sw, F32(1e-30)))
    return s.astype(F32), m.astype(F32)


def search_int4_params(g: np.ndarray, a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """g [..., G] groups, a [..., G] importance -> bf16 (scale, low) [...] minimizing each group's error."""
    lo, hi = g.min(axis=-1), g.max(axis=-1)  # [...]
    best_s, best_m = round_bf16((hi - lo) / F32(15)), round_bf16(lo)  # min/max
    best_err = int4_error(g, best_s, best_m, a)
    span = np.where(hi > lo, hi - lo, F32(1))
    for delta in DELTAS_INT4:
        inv_step = (F32(15) + F32(delta)) / span  # [...]
        codes = np.clip(np.rint((g - lo[..., None]) * inv_step[..., None]), 0, 15)  # [..., G]
        s, m = _least_squares(g, codes, a)
        s, m = round_bf16(np.maximum(s, F32(0))), round_bf16(m)
        err = int4_error(g, s, m, a)
        better = err < best_err
        best_s, best_m = np.where(better, s, best_s), np.where(better, m, best_m)
        best_err = np.where(better, err, best_err)
    return best_s, best_m


def quantize_int4_search(w: np.ndarray, group: int, a: np.ndarray | None = None) -> QuantizedLinear:
    w = np.asarray(w, F32)  # [N, K]
    N, K = w.shape
    g = int4_groups(w, group)  # [N, ceil(K/G), G]
    a_groups = int4_groups(_importance(a, K)[None, :], group)  # [1, ceil(K/G), G]; edge padding repeats the last
    pad = -K % group
    if pad:  # padded columns are copies: they must not count twice
        a_groups = a_groups.copy()
        a_groups[:, -1, group - pad:] = 0
    scale, low = search_int4_params(g, np.broadcast_to(a_groups, g.shape))
    return int4_linear(w, scale, low, group)


ROWS_AT_ONCE = 4096  # bounds the candidates' temporaries (an lm_head has 10^5 rows)


def row_errors(w: np.ndarray, w_hat_of, h: np.ndarray, rows: int = ROWS_AT_ONCE) -> np.ndarray:
    """w [N, K], w_hat_of(r0, r1) -> ŵ [r1 − r0, K] (the rows' quantized values), h [K, K] -> [N]: each row's
    output error (w_n − ŵ_n) H (w_n − ŵ_n)ᵀ, fp32 products, float64 sums, `rows` rows at a time (so no ŵ of a
    whole 10^5-row lm_head is ever held)."""
    h32, out = np.asarray(h, F32), np.zeros(len(w))
    for r0 in range(0, len(w), rows):
        r1 = min(r0 + rows, len(w))
        d = np.asarray(w[r0:r1], F32) - w_hat_of(r0, r1)  # [r1 − r0, K]
        out[r0:r1] = np.sum((d @ h32) * d, axis=1, dtype=np.float64)  # [r1 − r0, K] @ [K, K] -> Σ_k
    return out


def quantize_search(spec, w: np.ndarray, a: np.ndarray | None = None) -> QuantizedLinear:
    """The spec's format (a QuantSpec, int8 or int4:G) with searched parameters; a: column importance [K] or None.
    Rows are independent: searched ROWS_AT_ONCE at a time and stacked."""
    one = (lambda rows: quantize_int8_search(rows, a)) if spec.format == "int8" else (
        lambda rows: quantize_int4_search(rows, spec.group, a))
    return stack_rows([one(w[i:i + ROWS_AT_ONCE]) for i in range(0, w.shape[0], ROWS_AT_ONCE)])


def stack_rows(parts: list[QuantizedLinear]) -> QuantizedLinear:
    """Row blocks of one int8/int4 matrix -> the whole matrix."""
    cat = lambda arrays: None if arrays[0] is None else np.concatenate(arrays)  # noqa: E731
    first = parts[0]
    return QuantizedLinear(first.format, (sum(p.shape[0] for p in parts), first.shape[1]),
                           cat([p.data for p in parts]), cat([p.scales for p in parts]),
                           cat([p.mins for p in parts]), first.group)
