"""The NumPy reference implementation of the op interface (`refimpl.model.interface` documents every op).

float32 in, float32 out. Each op is a small pure function; the shape comments use the letters declared in
`refimpl.model.interface` (T tokens, S cache, D hidden, F ffn, V vocab, H q-heads, K kv-heads, E head_dim, R rank,
N image tokens). The vision ops (`interface.VisionOps`) follow the text ops.
"""
from __future__ import annotations

import numpy as np

from refimpl.model.config import RopeScaling
from refimpl.quant.schemes import QuantizedLinear

F32 = np.float32


def embedding(ids, table):
    return table[ids]  # [V, D][T] -> [T, D]


def rms_norm(x, weight, eps):
    variance = np.mean(x * x, axis=-1, keepdims=True)  # [T, D] -> [T, 1]
    return x / np.sqrt(variance + F32(eps)) * weight  # [T, D] * [D] -> [T, D]


def llama3_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    """Inverse frequencies [E/2], fp32, as HF computes them (including the three llama3 wavelength bands)."""
    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(F32) / F32(head_dim)  # [E/2]
    inv_freq = (F32(1.0) / np.power(F32(theta), exponent)).astype(F32)  # [E/2]
    if scaling is None:
        return inv_freq
    factor, old_len = F32(scaling.factor), F32(scaling.original_max_position_embeddings)
    low_wavelen = old_len / F32(scaling.low_freq_factor)  # longer wavelengths than this: divide by factor
    high_wavelen = old_len / F32(scaling.high_freq_factor)  # shorter than this: keep
    wavelen = F32(2 * np.pi) / inv_freq  # [E/2]
    scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    # between the two bands, interpolate smoothly between the scaled and the original frequency
    smooth = (old_len / wavelen - F32(scaling.low_freq_factor)) / F32(scaling.high_freq_factor -
                                                                      scaling.low_freq_factor)
    smoothed = (F32(1) - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(F32)


def rope_tables(positions, head_dim, theta, scaling):
    inv_freq = llama3_inv_freq(head_dim, theta, scaling)  # [E/2]
    angles = np.asarray(positions).astype(F32)[:, None] * inv_freq[None, :]  # [T, 1] * [1, E/2] -> [T, E/2]
    return np.cos(angles), np.sin(angles)


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]  # [T, H, E] -> 2 × [T, H, E/2]
    c, s = cos[:, None, :], sin[:, None, :]  # [T, E/2] -> [T, 1, E/2]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)  # -> [T, H, E]


def rope(q, k, cos, sin):
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def linear(x, weight):
    if isinstance(weight, QuantizedLinear):  # a quantized model runs on its dequantized values, in fp32
        weight = weight.values  # dequantized once, [Dout, Din]
    return x @ weight.T  # [T, Din] @ [Din, Dout] -> [T, Dout]


def softmax(scores):
    scores = scores - scores.max(axis=-1, keepdims=True)
    e = np.exp(scores)
    return e / e.sum(axis=-1, keepdims=True)


def _grouped_attention(q, k, v, visible):
    """q [T, H, E], k/v [K, N, E], visible [T, N] bool -> [T, H, E]; every row must see at least one key."""
    T, H, E = q.shape
    K = k.shape[0]
    qg = q.reshape(T, K, H // K, E).transpose(1, 2, 0, 3)  # [T, H, E] -> [K, H/K, T, E]
    scores = qg @ k[:, None].transpose(0, 1, 3, 2) / F32(np.sqrt(E))  # [K, H/K, T, E] @ [K, 1, E, N] -> [K, H/K, T, N]
    scores = np.where(visible, scores, F32(-np.inf))  # [T, N] broadcasts over [K, H/K]
    out = softmax(scores) @ v[:, None]  # [K, H/K, T, N] @ [K, 1, N, E] -> [K, H/K, T, E]
    return out.transpose(2, 0, 1, 3).reshape(T, H, E)  # [K, H/K, T, E] -> [T, H, E]


def attention(q, k, v, cache_k, cache_v, positions):
    positions = np.asarray(positions)
    cache_k[:, positions] = k.transpose(1, 0, 2)  # [T, K, E] -> [K, T, E] into [K, S, E]
    cache_v[:, positions] = v.transpose(1, 0, 2)
    n = int(positions.max()) + 1  # keys 0..n-1 are all any query here may see
    visible = np.arange(n)[None, :] <= positions[:, None]  # [T, n]: causal mask by absolute position
    return _grouped_attention(q, cache_k[:, :n], cache_v[:, :n], visible)


def swiglu(gate, up):
    return gate / (F32(1) + np.exp(-gate)) * up  # silu(gate) · up, [T, F]


def cross_attention(q, k, v, mask=None):
    T, N = q.shape[0], k.shape[1]
    visible = np.ones((T, N), dtype=bool) if mask is None else np.asarray(mask, dtype=bool)  # [T, N]
    # A text token before any image sees no key; attend to everything and then zero the row, as Mllama does.
    empty = ~visible.any(axis=-1)  # [T]
    out = _grouped_attention(q, k, v, visible | empty[:, None])
    return np.where(empty[:, None, None], F32(0), out)  # [T, H, E]


def lora_merge(weight, lora_a, lora_b, scale):
    delta = lora_b.astype(F32) @ lora_a.astype(F32)  # [Dout, R] @ [R, Din] -> [Dout, Din]
    return (weight.astype(F32) + F32(scale) * delta).astype(weight.dtype)


def lora_linear(x, weight, lora_a, lora_b, scale):
    low = x.astype(F32) @ lora_a.T.astype(F32)  # [T, Din] @ [Din, R] -> [T, R]
    delta = low @ lora_b.T.astype(F32)  # [T, R] @ [R, Dout] -> [T, Dout]
    return (linear(x, weight) + F32(scale) * delta).astype(x.dtype)


# ---- vision ops (interface.VisionOps) ----

def layer_norm(x, weight, bias, eps):
    mean = np.mean(x, axis=-1, keepdims=True)  # [..., U] -> [..., 1]
    centered = x - mean
    variance = np.mean(centered * centered, axis=-1, keepdims=True)  # biased, as torch's LayerNorm
    return centered / np.sqrt(variance + F32(eps)) * weight + bias  # [..., U] * [U] + [U] -> [..., U]


# Coefficients of the Chebyshev fit to erfc(z)·exp(z²) (Numerical Recipes, `erfcc`): fractional error < 1.2e-7
# everywhere, evaluated in float64, so erf is good to the last bit of a float32 result.
_ERFC_COEFFS = (-1.26551223, 1.00002368, 0.37409196, 0.09678418, -0.18628806, 0.27886807, -1.13520398,
                1.48851587, -0.82215223, 0.17087277)


def erf(x):
    z = np.abs(np.asarray(x, np.float64))
    t = 1.0 / (1.0 + 0.5 * z)
    poly = np.zeros_like(z)
    for c in reversed(_ERFC_COEFFS[1:]):
        poly = (poly + c) * t
    erfc = t * np.exp(-z * z + _ERFC_COEFFS[0] + poly)
    return np.where(np.asarray(x) >= 0, 1.0 - erfc, erfc - 1.0)


def gelu(x):
    """x · Φ(x) with the exact (erf) normal CDF, as torch's default GELU (HF's ACT2FN['gelu']); no tanh form."""
    x64 = np.asarray(x, np.float64)
    return (0.5 * x64 * (1.0 + erf(x64 / np.sqrt(2.0)))).astype(F32)


ENCODER_QUERY_BLOCK = 512  # a 4-tile image has L = 6432: whole [H, L, L] scores would take 2.6 GB in fp32


def encoder_attention(q, k, v, mask=None):
    L = q.shape[0]
    visible = np.ones((L, L), dtype=bool) if mask is None else np.asarray(mask, dtype=bool)  # [L, L]
    kt, vt = k.transpose(1, 0, 2), v.transpose(1, 0, 2)  # [L, K, E] -> [K, L, E]
    blocks = range(0, L, ENCODER_QUERY_BLOCK)  # rows are independent: blocks of queries bound the score matrix
    return np.concatenate([_grouped_attention(q[s:s + ENCODER_QUERY_BLOCK], kt, vt,
                                              visible[s:s + ENCODER_QUERY_BLOCK]) for s in blocks])  # [L, H, E]
