"""GPTQ (Frantar et al., 2022): quantize a weight matrix column by column, pushing each column's rounding error onto
the columns not yet quantized, weighted by the inverse Hessian of the layer's squared output error.

For a linear layer y = W x with calibration inputs X [T, K] (the rows are tokens), the output error of replacing W
by Ŵ is  ‖(W − Ŵ) Xᵀ‖² = Σ_n (w_n − ŵ_n) H (w_n − ŵ_n)ᵀ  with H = Xᵀ X [K, K], one quadratic form a row. Quantizing
column j and then re-solving the remaining columns optimally is, in closed form (the OBS update),

    e = (W[:, j] − Q[:, j]) / U[j, j]            W[:, j+1:] −= e ⊗ U[j, j+1:]

where U is the upper Cholesky factor of H⁻¹ (H⁻¹ = Uᵀ U): row j of U holds the inverse Hessian of the columns
≥ j with the columns < j already eliminated, so one factorization serves every step. Columns are processed in
blocks of BLOCK: inside a block the update touches the block's columns only, and the block's accumulated errors
reach the later columns in one matrix product (the paper's "lazy batch" update: the same result, fewer passes).

H gets 1% of its mean diagonal added (damping: X is rank-deficient with few calibration tokens); a column no
calibration token excites (H[j, j] = 0) is set to 0, as in the paper's code. The grid is refimpl.quant.formats'
(int8: a scale a row; int4: a scale and a minimum per group of G columns), chosen once before the sweep from the
whole matrix (the reference code's `static_groups`), by min/max or by refimpl.quant.search weighted with H's
diagonal. With `act_order` the sweep visits columns by decreasing H[j, j] (the reference's `act_order`): the
columns the inputs excite most are quantized first, while the most error can still be pushed onto the others;
codes are stored at their own columns, so the layout is unchanged. [N, K] = [Dout, Din].
"""
from __future__ import annotations

import numpy as np

from refimpl.quant.formats import F32, QuantError, QuantizedLinear, int4_codes, int8_codes, pack_nibbles
from refimpl.quant.search import importance_of, quantize_search

BLOCK = 128
DAMP = 0.01


def inverse_hessian_factor(h: np.ndarray, damp: float = DAMP) -> np.ndarray:
    """H [K, K] -> U [K, K] upper with H⁻¹ = Uᵀ U after damping (columns with H[j, j] = 0 made 1 first)."""
    h = np.array(h, np.float64)
    dead = np.diag(h) == 0
    h[dead, dead] = 1
    h[np.diag_indices_from(h)] += damp * np.mean(np.diag(h))
    try:
        h_inv = np.linalg.inv(h)
        return np.linalg.cholesky(h_inv).T  # lower L with H⁻¹ = L Lᵀ -> U = Lᵀ
    except np.linalg.LinAlgError:
        raise QuantError("GPTQ: the damped Hessian is not positive definite (non-finite calibration "
                         "activations?)") from None


def grid(w: np.ndarray, spec, importance: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
    """The static grid: bf16 (scales, minima or None), [N, ceil(K/G)] each; by search when `importance` [K] is
    given, else min/max."""
    w = np.asarray(w, F32)
    if importance is None:
        q = spec.quantize(w)
    else:
        q = quantize_search(spec, w, importance)
    return q.scales, q.mins


def gptq_quantize(w: np.ndarray, h: np.ndarray, spec, search: bool = True, act_order: bool = True,
                  block: int = BLOCK, damp: float = DAMP) -> QuantizedLinear:
    """w [N, K], h = Xᵀ X [K, K] from calibration inputs, spec a QuantSpec (int8 or int4:G) -> QuantizedLinear.
    `search`: the grid by importance-weighted search instead of min/max."""
    N, K = w.shape
    if h.shape != (K, K):
        raise QuantError(f"GPTQ: the Hessian is {list(h.shape)}, expected [{K}, {K}] for a [{N}, {K}] weight")
    W = np.array(w, np.float64)  # [N, K]
    dead = np.diag(h) == 0
    W[:, dead] = 0
    scales, lows = grid(W, spec, importance_of(h) if search else None)
    G = K if spec.format == "int8" else spec.group
    order = np.argsort(-np.diag(h), kind="stable") if act_order else np.arange(K)  # [K]: the sweep's columns
    u = inverse_hessian_factor(h[np.ix_(order, order)], damp)
    W = W[:, order]  # [N, K] in sweep order, updated in place as the sweep goes
    codes = np.zeros((N, K), np.int8 if lows is None else np.uint8)  # at the columns' own positions
    for b0 in range(0, K, block):
        b1 = min(b0 + block, K)
        err = np.zeros((N, b1 - b0))  # [N, b1-b0]: the scaled errors e of this block's columns
        for j in range(b0, b1):
            gi = order[j] // G
            col = W[:, j:j + 1].astype(F32)  # [N, 1]
            if lows is None:
                q = int8_codes(col, scales[:, gi:gi + 1])[:, 0]
                deq = q.astype(F32) * scales[:, gi]
            else:
                q = int4_codes(col, scales[:, gi], lows[:, gi])[:, 0]
                deq = q.astype(F32) * scales[:, gi] + lows[:, gi]
            codes[:, order[j]] = q
            e = (W[:, j] - deq) / u[j, j]  # [N]
            W[:, j + 1:b1] -= np.outer(e, u[j, j + 1:b1])  # [N] ⊗ [b1-j-1]
            err[:, j - b0] = e
        W[:, b1:] -= err @ u[b0:b1, b1:]  # [N, b1-b0] @ [b1-b0, K-b1] -> [N, K-b1]: the lazy batch update
    if lows is None:
        return QuantizedLinear("int8", (N, K), codes, scales, None, K)
    return QuantizedLinear("int4", (N, K), pack_nibbles(codes), scales, lows, G)
