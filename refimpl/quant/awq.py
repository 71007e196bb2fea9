"""Activation-aware scaling (AWQ, Lin et al., 2023): scale each input column of a weight up by s[k] before it is
quantized and divide the input by s[k], folded into the op that produces the input, so the unquantized model
computes the same function while the columns the inputs excite most get a finer relative grid.

For y = W x, W x = (W diag(s)) (diag(s)⁻¹ x): W·diag(s) is quantized, and diag(s)⁻¹ disappears into what made x:

    q, k, v (input: the attention RMSNorm)   input_layernorm.weight / s        (RMSNorm ends with × weight)
    o (input: the attention output)          v_proj's rows / t                 (attention is linear in v)
    gate, up (input: the MLP RMSNorm)        post_attention_layernorm.weight / s
    down (input: silu(gate) · up)            up_proj's rows / s                (the product is linear in up)
    lm_head (input: the final RMSNorm)       model.norm.weight / s             (a tied head is its own tensor)

With grouped-query attention o's column h·E + e reads v's row (h // (H/K))·E + e, so o's scales are tied: one t a
v row, repeated over the H/K query heads that share it.

The scales are s = p^(α/2) for the column's mean square input p (the diagonal of the calibration Hessian
H = Σ xᵀx), normalized to geometric mean 1 between the smallest and the largest (AWQ's code: s / sqrt(max · min)),
with α on a grid in [0, 1] chosen to minimize the layer's output error on the calibration inputs,
Σ_n (w_n − ŵ_n) H (w_n − ŵ_n)ᵀ (refimpl.quant.gptq's quadratic form), of the round-to-nearest quantization
ŵ = Q(w·s) / s. α = 0 (s = 1, no scaling) is on the grid, so the search never makes round-to-nearest worse.
AWQ's paper uses the mean |x| and the same grid; p is the mean square because H holds it already.
[N, K] = [Dout, Din] as in refimpl.quant.schemes.
"""
from __future__ import annotations

import numpy as np

from refimpl.quant.schemes import F32
from refimpl.quant.search import ROWS_AT_ONCE, row_errors

ALPHAS = np.linspace(0.0, 1.0, 11)
FLOOR = 1e-8  # relative floor of p: a column no calibration token excites keeps a finite scale
def output_error(w: np.ndarray, s: np.ndarray, h: np.ndarray, quantize, rows: int = ROWS_AT_ONCE) -> float:
    """w [N, K], s [K], h [K, K], quantize as in search_scales -> Σ_n (w_n − ŵ_n) H (w_n − ŵ_n)ᵀ = ‖(W − Ŵ) Xᵀ‖²
    for H = XᵀX and ŵ = Q(w·s) / s, `rows` rows at a time (each row is quantized on its own)."""
    return float(row_errors(w, lambda r0, r1: quantize(w[r0:r1] * s).values / s, h, rows).sum())


def scales_for(p: np.ndarray, alpha: float) -> np.ndarray:
    """Column powers p [K] (> 0) -> s [K] = p^(α/2), normalized so that max(s) · min(s) = 1."""
    s = p ** (alpha / 2)
    return (s / np.sqrt(s.max() * s.min())).astype(F32)


def tied_columns(cfg) -> np.ndarray:
    """o_proj's column -> the v_proj row it reads, [H·E]: column h·E + e <- row (h // (H/K))·E + e."""
    heads = np.arange(cfg.num_attention_heads) // cfg.gqa_group  # [H]: each query head's kv head
    return (heads[:, None] * cfg.head_dim + np.arange(cfg.head_dim)[None, :]).reshape(-1)  # [H, E] -> [H·E]


def search_scales(w: np.ndarray, h: np.ndarray, quantize, tie: np.ndarray | None = None) -> np.ndarray:
    """w [N, K] (the matrices sharing one input, stacked by rows), h [K, K] their calibration Hessian,
    quantize: fp32 [N, K] -> QuantizedLinear (round to nearest) -> the best s [K] on ALPHAS.
    tie [K]: index of each column's shared scale (o_proj's columns, tied_columns), or None."""
    p = np.diag(h).astype(np.float64)  # [K]
    if tie is not None:
        p = np.bincount(tie, weights=p) / np.bincount(tie)  # [rows of v]: the mean over the columns a row feeds
    p = np.maximum(p, FLOOR * p.max())
    best, best_err = None, np.inf
    for alpha in ALPHAS:
        s = scales_for(p, alpha)
        s = s if tie is None else s[tie]  # [K]
        err = output_error(w, s, h, quantize)
        if err < best_err:
            best, best_err = s, err
    return best


def fold(p: dict, scales: dict, cfg) -> dict:
    """A layer's params (keyed as refimpl.model.llama.layer_params) and its scales {"qkv": s [D], "o": t [K·E]
    (a v row's), "gate_up": s [D], "down": s [F]} -> the same function with W·diag(s) and the inputs divided."""
    s_qkv, t, s_mlp, s_down = (np.asarray(scales[k], F32) for k in ("qkv", "o", "gate_up", "down"))
    tie = tied_columns(cfg)
    out = dict(p)
    out["input_layernorm.weight"] = p["input_layernorm.weight"] / s_qkv  # [D]
    for key in ("self_attn.q_proj.weight", "self_attn.k_proj.weight"):
        out[key] = p[key] * s_qkv  # [Dout, D] * [D]
    out["self_attn.v_proj.weight"] = p["self_attn.v_proj.weight"] * s_qkv / t[:, None]  # [K·E, D]: columns, rows
    out["self_attn.o_proj.weight"] = p["self_attn.o_proj.weight"] * t[tie]  # [D, H·E] * [H·E]
    out["post_attention_layernorm.weight"] = p["post_attention_layernorm.weight"] / s_mlp  # [D]
    out["mlp.gate_proj.weight"] = p["mlp.gate_proj.weight"] * s_mlp  # [F, D] * [D]
    out["mlp.up_proj.weight"] = p["mlp.up_proj.weight"] * s_mlp / s_down[:, None]  # [F, D]: columns, rows
    out["mlp.down_proj.weight"] = p["mlp.down_proj.weight"] * s_down  # [D, F] * [F]
    return out


def scaled_hessian(h: np.ndarray, s: np.ndarray) -> np.ndarray:
    """The Hessian of the divided inputs x / s: diag(s)⁻¹ H diag(s)⁻¹, [K, K]."""
    inv = 1.0 / np.asarray(s, np.float64)
    return h * inv[:, None] * inv[None, :]
