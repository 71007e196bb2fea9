"""Backward passes of the ops training runs through, in NumPy: the oracle every accel backward is tested against.

Each `<op>_backward` takes the forward's inputs and the gradient of the loss with respect to the forward's output
(`d_out`, same shape as the output) and returns the gradients with respect to the inputs, in the forward's
argument order. The forwards are `refimpl.model.ops`'s; dtype follows the inputs (tests run float64).
Shape letters as in refimpl/model/interface.py (T tokens, S keys, D hidden, F ffn, V vocab, H/K heads, E head_dim,
R LoRA rank; Din/Dout a linear layer's sides).
"""
from __future__ import annotations

import numpy as np

from refimpl.model import ops

IGNORE_INDEX = -100  # labels with this value carry no loss (HF / torch convention)


def attention_visible(T: int, S: int, causal: bool, mask=None) -> np.ndarray:
    """[T, S] bool: key s visible to query t iff mask[t, s] and, if causal, s <= t (top-left aligned)."""
    visible = np.ones((T, S), dtype=bool) if mask is None else np.asarray(mask, dtype=bool)
    return visible & (np.arange(S)[None, :] <= np.arange(T)[:, None]) if causal else visible


def attention_backward(q, k, v, d_out, causal: bool = True, mask=None):
    """Scaled-dot-product attention of one sequence, GQA (query head h reads kv head h // (H/K)), scale 1/sqrt(E).
    q [T, H, E], k/v [S, K, E], mask [T, S] bool or None, d_out [T, H, E] -> (dq [T, H, E], dk, dv [S, K, E]).
    A row that sees no key has output 0 and contributes no gradient."""
    T, H, E = q.shape
    S, K, _ = k.shape
    visible = attention_visible(T, S, causal, mask)  # [T, S]
    empty = ~visible.any(axis=-1)  # [T]
    qg = q.reshape(T, K, H // K, E).transpose(1, 2, 0, 3)  # [T, H, E] -> [K, H/K, T, E]
    kk = k.transpose(1, 0, 2)[:, None]  # [S, K, E] -> [K, 1, S, E]
    vv = v.transpose(1, 0, 2)[:, None]  # [S, K, E] -> [K, 1, S, E]
    do = d_out.reshape(T, K, H // K, E).transpose(1, 2, 0, 3)  # [T, H, E] -> [K, H/K, T, E]
    scale = 1.0 / np.sqrt(E)

    scores = qg @ kk.transpose(0, 1, 3, 2) * scale  # [K, H/K, T, E] @ [K, 1, E, S] -> [K, H/K, T, S]
    p = ops.softmax(np.where(visible | empty[:, None], scores, -np.inf))  # [K, H/K, T, S]
    p = np.where(empty[:, None], 0.0, p)  # empty rows: no probability mass, so no gradient

    dv = (p.transpose(0, 1, 3, 2) @ do).sum(axis=1)  # [K, H/K, S, T] @ [K, H/K, T, E] -> sum over group: [K, S, E]
    dp = do @ vv.transpose(0, 1, 3, 2)  # [K, H/K, T, E] @ [K, 1, E, S] -> [K, H/K, T, S]
    ds = p * (dp - (p * dp).sum(axis=-1, keepdims=True))  # softmax backward, [K, H/K, T, S]
    dq = ds @ kk * scale  # [K, H/K, T, S] @ [K, 1, S, E] -> [K, H/K, T, E]
    dk = (ds.transpose(0, 1, 3, 2) @ qg).sum(axis=1) * scale  # [K, H/K, S, T] @ [K, H/K, T, E] -> [K, S, E]
    return (dq.transpose(2, 0, 1, 3).reshape(T, H, E),  # [K, H/K, T, E] -> [T, H, E]
            dk.transpose(1, 0, 2), dv.transpose(1, 0, 2))  # [K, S, E] -> [S, K, E]


def rms_norm_backward(x, weight, eps: float, d_out):
    """y = x · r · weight with r = 1/sqrt(mean(x²) + eps).
    x [T, D], weight [D], d_out [T, D] -> (dx [T, D], dweight [D])."""
    r = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)  # [T, D] -> [T, 1]
    dweight = (d_out * x * r).sum(axis=0)  # [T, D] -> [D]
    d_norm = d_out * weight  # gradient w.r.t. the normalized x·r, [T, D]
    # r depends on x: d(x·r)/dx = r·(I − r²·x xᵀ / D)
    dx = r * (d_norm - x * r * r * np.mean(d_norm * x, axis=-1, keepdims=True))  # [T, D]
    return dx, dweight


def rope_backward(d_q, d_k, cos, sin):
    """RoPE is a rotation per (position, frequency) pair, so its backward is the inverse rotation (angle -θ).
    d_q [T, H, E], d_k [T, K, E] (gradients w.r.t. the rotated q/k), cos/sin [T, E/2] -> (dq, dk)."""
    return ops.rope(d_q, d_k, cos, -sin)


def swiglu_backward(gate, up, d_out):
    """y = silu(gate) · up. gate/up/d_out [T, F] -> (dgate, dup), [T, F] each."""
    sig = 1.0 / (1.0 + np.exp(-gate))  # σ(gate), [T, F]
    silu = gate * sig
    dsilu = sig * (1.0 + gate * (1.0 - sig))  # d silu / d gate
    return d_out * up * dsilu, d_out * silu


def lora_linear_backward(x, weight, lora_a, lora_b, scale: float, d_out):
    """y = x Wᵀ + scale · (x Aᵀ) Bᵀ, W frozen. x [T, Din], weight [Dout, Din], lora_a [R, Din], lora_b [Dout, R],
    d_out [T, Dout] -> (dx [T, Din], dA [R, Din], dB [Dout, R])."""
    h = x @ lora_a.T  # [T, Din] @ [Din, R] -> [T, R]
    d_h = scale * (d_out @ lora_b)  # [T, Dout] @ [Dout, R] -> [T, R]
    d_b = scale * (d_out.T @ h)  # [Dout, T] @ [T, R] -> [Dout, R]
    d_a = d_h.T @ x  # [R, T] @ [T, Din] -> [R, Din]
    dx = d_out @ weight + d_h @ lora_a  # [T, Dout] @ [Dout, Din] + [T, R] @ [R, Din] -> [T, Din]
    return dx, d_a, d_b


def log_softmax(logits):
    shifted = logits - logits.max(axis=-1, keepdims=True)  # [T, V]
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def cross_entropy(logits, labels, n_labels: int | None = None) -> float:
    """Mean over label tokens of −log softmax(logits)[label]; labels == -100 are ignored. logits [T, V],
    labels [T] int. `n_labels` is the divisor (default: the label tokens here; the whole optimizer step's count
    when micro-batches are accumulated)."""
    labels = np.asarray(labels)
    keep = labels != IGNORE_INDEX  # [T]
    n = int(keep.sum()) if n_labels is None else n_labels
    picked = log_softmax(logits[keep])[np.arange(int(keep.sum())), labels[keep]]  # [T'] of [T', V]
    return float(-picked.sum() / max(n, 1))


def cross_entropy_backward(logits, labels, n_labels: int | None = None):
    """d cross_entropy / d logits, [T, V]: (softmax − one_hot(label)) / n on label rows, 0 on ignored rows."""
    labels = np.asarray(labels)
    keep = labels != IGNORE_INDEX  # [T]
    n = int(keep.sum()) if n_labels is None else n_labels
    d = np.exp(log_softmax(logits))  # softmax, [T, V]
    d[np.arange(len(labels))[keep], labels[keep]] -= 1.0
    return np.where(keep[:, None], d, 0.0) / max(n, 1)
