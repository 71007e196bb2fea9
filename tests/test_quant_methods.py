"""Offline quantizers (refimpl.quant.search, refimpl.quant.gptq) against independent computations: brute-force
nearest codes, the published GPTQ update re-derived step by step in the test, and the layer output error."""
from __future__ import annotations

import numpy as np
import pytest

from refimpl.quant.schemes import QuantizedLinear, QuantSpec, round_bf16, unpack_nibbles
from refimpl.quant.gptq import gptq_quantize
from refimpl.quant.search import quantize_search


def heavy_tailed(shape, seed):
    """Weights like a trained model's: mostly small, a few large (Student's t with 3 degrees of freedom)."""
    return (0.02 * np.random.default_rng(seed).standard_t(3, size=shape)).astype(np.float32)


def correlated_inputs(T, K, seed, outliers=(3,)):
    """Calibration inputs [T, K] with correlated columns and a few large-magnitude columns (as real activations)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, K)) @ (np.eye(K) + 0.5 * rng.standard_normal((K, K)) / np.sqrt(K))
    x[:, list(outliers)] *= 20
    return x.astype(np.float32)


def codes_of(q: QuantizedLinear) -> np.ndarray:
    return unpack_nibbles(q.data) if q.format == "int4" else q.data


def output_error(w, q: QuantizedLinear, x) -> float:
    """‖(W − Ŵ) Xᵀ‖², the layer output's squared error over the inputs x [T, K]."""
    d = (w.astype(np.float64) - q.dequantize()) @ x.T.astype(np.float64)  # [N, K] @ [K, T] -> [N, T]
    return float((d * d).sum())


# ---------------------------------------------------------------- the range search

def brute_force_codes(w, scale, low, G, levels):
    """For every element the level index c minimizing |w − (c·s + m)| (ties: the first)."""
    per_col = np.arange(w.shape[1]) // G  # [K]
    s, m = scale[:, per_col], (0 if low is None else low[:, per_col])  # [N, K]
    grid = levels[:, None, None] * s[None] + m  # [L, N, K]
    return np.abs(grid - w[None]).argmin(axis=0) + (levels[0] if low is None else 0)  # [N, K]


@pytest.mark.parametrize("spec", [QuantSpec("int8"), QuantSpec("int4", 32), QuantSpec("int4", 64)])
def test_search_keeps_the_format_and_beats_min_max_per_row(spec):
    w = heavy_tailed((24, 160), seed=1)  # K = 160: int4:64's last group is short
    a = np.random.default_rng(2).uniform(0.1, 5, 160).astype(np.float32)  # column importance
    rtn, found = spec.quantize(w), quantize_search(spec, w, a)
    assert found.format == rtn.format and found.data.shape == rtn.data.shape and found.scales.shape == rtn.scales.shape
    assert np.array_equal(found.scales, round_bf16(found.scales))  # parameters are bf16 values
    if found.mins is not None:
        assert np.array_equal(found.mins, round_bf16(found.mins))
    # the codes are the nearest ones for the chosen grid (checked by brute force over every level)
    levels = np.arange(-127, 128) if spec.format == "int8" else np.arange(16)
    G = spec.group or w.shape[1]
    want = brute_force_codes(w, found.scales, found.mins, G, levels.astype(np.float32))
    got = codes_of(found).astype(np.int64)
    assert (got == want).mean() > 0.999  # exact ties (w half-way between two levels) may go either way
    err = lambda q: ((w - q.dequantize()) ** 2 * a).sum(axis=1)  # noqa: E731  [N] weighted errors
    assert np.all(err(found) <= err(rtn) * (1 + 1e-6))  # min/max is one of the candidates
    gain = 1.0 if spec.format == "int8" else 0.9  # 255 levels leave little to gain; 16 levels a lot
    assert err(found).sum() < gain * err(rtn).sum()


# ---------------------------------------------------------------- GPTQ

def published_gptq(w, h, spec, grid_scales, grid_mins, order, damp=0.01):
    """GPTQ as the paper derives it from optimal brain quantization, without its Cholesky and lazy-batch tricks:
    keep the inverse Hessian of the not-yet-quantized columns explicitly; quantize column j; spread its error
    with −(w_j − q_j) / [H⁻¹]_jj · [H⁻¹]_j,: ; then remove j from H⁻¹ by one step of Gaussian elimination.
    Columns are visited in `order`; the grid (scales, minima) is given."""
    N, K = w.shape
    h = h.astype(np.float64).copy()
    h[np.diag_indices(K)] += damp * np.mean(np.diag(h))
    h_inv = np.linalg.inv(h)
    W = w.astype(np.float64).copy()
    G = K if spec.format == "int8" else spec.group
    codes = np.zeros((N, K), np.int64)
    for j in order:
        s = grid_scales[:, j // G].astype(np.float64)
        if spec.format == "int8":
            q = np.clip(np.rint(W[:, j].astype(np.float32) / grid_scales[:, j // G]), -127, 127)
            deq = q * s
        else:
            m = grid_mins[:, j // G]
            q = np.clip(np.rint((W[:, j].astype(np.float32) - m) / grid_scales[:, j // G]), 0, 15)
            deq = q * s + m
        codes[:, j] = q
        err = (W[:, j] - deq) / h_inv[j, j]  # [N]
        W -= np.outer(err, h_inv[j])  # [N] ⊗ [K]: the OBS update of every remaining column
        W[:, j] = deq  # (the update made column j exactly deq already; set it to avoid drift)
        h_inv -= np.outer(h_inv[:, j], h_inv[j]) / h_inv[j, j]  # eliminate j
    return codes


@pytest.mark.parametrize("spec", [QuantSpec("int8"), QuantSpec("int4", 8)])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_equals_the_published_algorithm_on_an_8x16_matrix(spec, act_order):
    w = heavy_tailed((8, 16), seed=3)
    x = correlated_inputs(48, 16, seed=4)
    h = x.T.astype(np.float64) @ x  # [K, K]
    got = gptq_quantize(w, h, spec, search=False, act_order=act_order, block=4)  # 4 lazy batches
    rtn = spec.quantize(w)  # the static min/max grid the reference is given
    assert np.array_equal(got.scales, rtn.scales)
    order = np.argsort(-np.diag(h), kind="stable") if act_order else np.arange(16)
    want = published_gptq(w, h, spec, rtn.scales, rtn.mins, order)
    assert np.array_equal(codes_of(got).astype(np.int64), want)
    assert not np.array_equal(codes_of(got), codes_of(rtn))  # the error feedback changed some codes


def dequantize_codes(codes, scales, mins, G):
    """codes [N, K] on a grid (scales, mins or None [N, ceil(K/G)]) -> float64 values [N, K]."""
    per_col = np.arange(codes.shape[1]) // G  # [K]
    return codes * scales[:, per_col].astype(np.float64) + (0 if mins is None else mins[:, per_col])


@pytest.mark.parametrize("spec", [QuantSpec("int8"), QuantSpec("int4", 8)])
def test_gptq_keeps_each_rows_better_grid(spec):
    """The published algorithm run on the min/max grid and on the searched grid, each row's output error measured
    on the inputs themselves: GPTQ's result is, row by row, the run whose row errs less."""
    w = heavy_tailed((40, 24), seed=21)
    x = correlated_inputs(96, 24, seed=22, outliers=(2, 9))
    h = x.T.astype(np.float64) @ x  # [K, K]
    got = gptq_quantize(w, h, spec, block=8)
    order = np.argsort(-np.diag(h), kind="stable")
    G = spec.group or 24
    runs = []
    for q in (spec.quantize(w), quantize_search(spec, w, np.diag(h) / np.diag(h).max())):  # the two grids
        codes = published_gptq(w, h, spec, q.scales, q.mins, order)
        d = (w - dequantize_codes(codes, q.scales, q.mins, G)) @ x.T.astype(np.float64)  # [N, K] @ [K, T]
        runs.append((codes, q.scales, q.mins, (d * d).sum(axis=1)))  # [N] output errors
    pick = np.argmin([r[3] for r in runs], axis=0)  # [N]
    assert 0 < pick.sum() < len(pick)  # each grid is the better one for some rows
    assert (got.mins is None) == (spec.format == "int8") and got.data.dtype == spec.quantize(w).data.dtype
    for n, i in enumerate(pick):
        assert np.array_equal(codes_of(got)[n], runs[i][0][n]) and np.array_equal(got.scales[n], runs[i][1][n])


@pytest.mark.parametrize("spec", [QuantSpec("int8"), QuantSpec("int4", 32)])
def test_gptq_reduces_the_layer_output_error(spec):
    w = heavy_tailed((32, 96), seed=5)
    x = correlated_inputs(400, 96, seed=6, outliers=(3, 40, 77))
    h = x.T.astype(np.float64) @ x
    rtn = output_error(w, spec.quantize(w), x)
    searched = output_error(w, quantize_search(spec, w, np.diag(h)), x)
    gptq = output_error(w, gptq_quantize(w, h, spec), x)
    assert searched < rtn
    assert gptq < 0.6 * rtn and gptq < searched


def test_gptq_zeroes_columns_no_input_excites():
    w = heavy_tailed((4, 32), seed=7)
    x = correlated_inputs(64, 32, seed=8)
    x[:, 5] = 0
    q = gptq_quantize(w, x.T.astype(np.float64) @ x, QuantSpec("int8"))
    assert np.all(q.dequantize()[:, 5] == 0)
