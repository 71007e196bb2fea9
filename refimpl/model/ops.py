"""The NumPy reference implementation of the op interface (`refimpl.model.interface` documents every op).

float32 in, float32 out. Each op is a small pure function; the shape comments use the letters declared in
`refimpl.model.interface` (T tokens, S cache, D hidden, F ffn, V vocab, H q-heads, K kv-heads, E head_dim, R rank,
N image tokens).
"""
from __future__ import annotations

import numpy as np

from refimpl.model.config import RopeScaling
from refimpl.quant.formats import QuantizedLinear

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
