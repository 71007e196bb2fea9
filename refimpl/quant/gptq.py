"""GPTQ (Frantar et al., 2022): quantize a weight matrix column by column, pushing each column's rounding error onto
the columns not yet quantized, weighted by the inverse Hessian of the layer's squared output error.

For a linear layer y = W x with calibration inputs X [T, K] (the rows are tokens), the output error of replacing W
by Ŵ is  ‖(W − Ŵ) Xᵀ‖² = Σ_n (w_n − ŵ_n) H (w_n − ŵ_n)ᵀ  with H = Xᵀ X [K, K], one quadratic form a row. Quantizing
column j and then re-solving the remaining columns optimally is, in closed form (the OBS update),

    e = (W[:, j] − Q[:, j]) / U[j, j]            W[:, j+1:] −= e ⊗ U[j, j+1:]

where U is the upper Cholesky factor of H⁻¹ (H⁻¹ = Uᵀ U): row j of U holds the inverse Hessian of the columns
≥ j with the columns < j already eliminated, so one factorization serves every step. Columns are processed in
blocks of BLOCK: inside a block, column j receives the errors of the block's earlier columns just before it is
quantized (Σ_i e_i U[i, j], one small product), and the block's errors reach the later columns in one matrix
product (the paper's "lazy batch" update: the same result, fewer passes). The sweep works on Wᵀ in fp32, as the
reference code does, so that each column is one contiguous row.

H gets 1% of its mean diagonal added (damping: X is rank-deficient with few calibration tokens); a column no
calibration token excites (H[j, j] = 0) is set to 0, as in the paper's code. The grid is refimpl.quant.schemes'
(int8: a scale a row; int4: a scale and a minimum per group of G columns), chosen once before the sweep from the
whole matrix (the reference code's `static_groups`): min/max, and the refimpl.quant.search ranges weighted with H's
diagonal; the sweep runs on each, and every row keeps the grid whose result leaves it the smaller output error
(rows are independent given their grid, so the choice is exact; a clipped range can lose to min/max here because
the error pushed forward moves later columns past the clip). With `act_order` the sweep visits columns by
decreasing H[j, j] (the reference's `act_order`): the columns the inputs excite most are quantized first, while the
most error can still be pushed onto the others; codes are stored at their own columns, so the layout is unchanged.
[N, K] = [Dout, Din].
"""
from __future__ import annotations

import numpy as np

from refimpl.errors import QuantError
from refimpl.quant.schemes import F32, QuantizedLinear, int4_codes, int8_codes, pack_nibbles
from refimpl.quant.search import importance_of, quantize_search, row_errors

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


def best_rows(w: np.ndarray, h: np.ndarray, candidates: list[QuantizedLinear]) -> QuantizedLinear:
    """Quantizations of one w [N, K] -> one whose row n is the candidate with the smallest output error on row n
    (the first on ties)."""
    if len(candidates) == 1:
        return candidates[0]
    errors = [row_errors(w, lambda r0, r1, q=q: q.take_rows(np.arange(r0, r1)).dequantize(), h) for q in candidates]
    pick = np.argmin(np.stack(errors), axis=0)  # [N]

    def rows(attr: str) -> np.ndarray | None:  # [N, ...]: row n from candidate pick[n]
        arrays = [getattr(q, attr) for q in candidates]
        return None if arrays[0] is None else np.choose(pick[:, None], arrays)

    first = candidates[0]
    return QuantizedLinear(first.format, first.shape, rows("data"), rows("scales"), rows("mins"), first.group)


def gptq_quantize(w: np.ndarray, h: np.ndarray, spec, search: bool = True, act_order: bool = True,
                  block: int = BLOCK, damp: float = DAMP) -> QuantizedLinear:
    """w [N, K], h = Xᵀ X [K, K] from calibration inputs, spec a QuantSpec (int8 or int4:G) -> QuantizedLinear.
    `search`: also sweep on the importance-weighted searched grid, each row keeping the better of the two."""
    N, K = w.shape
    if h.shape != (K, K):
        raise QuantError(f"GPTQ: the Hessian is {list(h.shape)}, expected [{K}, {K}] for a [{N}, {K}] weight")
    W = np.array(w, F32)  # [N, K]
    W[:, np.diag(h) == 0] = 0
    order = np.argsort(-np.diag(h), kind="stable") if act_order else np.arange(K)  # [K]: the sweep's columns
    u = inverse_hessian_factor(h[np.ix_(order, order)], damp).astype(F32)
    grids = [grid(W, spec, None)] + ([grid(W, spec, importance_of(h))] if search else [])
    return best_rows(W, h, [sweep(W, u, order, spec, scales, lows, block) for scales, lows in grids])


def sweep(W: np.ndarray, u: np.ndarray, order: np.ndarray, spec, scales: np.ndarray, lows: np.ndarray | None,
          block: int = BLOCK) -> QuantizedLinear:
    """The GPTQ sweep of W [N, K] on a fixed grid (scales, lows [N, ceil(K/G)]; lows None for int8), visiting the
    columns in `order` [K], u [K, K] the inverse Hessian's factor in that order."""
    N, K = W.shape
    G = K if spec.format == "int8" else spec.group
    Wt = np.ascontiguousarray(W.T[order])  # [K, N]: a column of W is a contiguous row here, in sweep order
    codes = np.zeros((K, N), np.int8 if lows is None else np.uint8)  # row k: column order[k]'s codes
    for b0 in range(0, K, block):
        b1 = min(b0 + block, K)
        err = np.zeros((b1 - b0, N), F32)  # [b1-b0, N]: the scaled errors e of this block's columns
        for j in range(b0, b1):
            gi = order[j] // G
            col = Wt[j] - u[b0:j, j] @ err[:j - b0]  # [N] − [j-b0] @ [j-b0, N]: the block's earlier errors
            if lows is None:
                q = int8_codes(col[:, None], scales[:, gi:gi + 1])[:, 0]
                deq = q.astype(F32) * scales[:, gi]
            else:
                q = int4_codes(col[:, None], scales[:, gi], lows[:, gi])[:, 0]
                deq = q.astype(F32) * scales[:, gi] + lows[:, gi]
            codes[j] = q
            err[j - b0] = (col - deq) / u[j, j]
        Wt[b1:] -= u[b0:b1, b1:].T @ err  # [K-b1, b1-b0] @ [b1-b0, N] -> [K-b1, N]: the lazy batch update
    codes = np.ascontiguousarray(codes[np.argsort(order)].T)  # [K, N] in sweep order -> [N, K] in place
    if lows is None:
        return QuantizedLinear("int8", (N, K), codes, scales, None, K)
    return QuantizedLinear("int4", (N, K), pack_nibbles(codes), scales, lows, G)
