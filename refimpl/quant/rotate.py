"""Residual-stream rotation before quantizing (QuaRot / SpinQuant style): the same function, new weights that an
axis-aligned quantization grid serves better.

A Llama block reads the residual stream x [T, D] only through an RMSNorm followed by linear layers, and writes it
only through o_proj and down_proj. Two exact rewrites, both done once on the weights, make the stream free to rotate:

1. Fold each RMSNorm's weight g into the matrices that read its output: W ← W·diag(g) for q/k/v (input_layernorm),
   gate/up (post_attention_layernorm) and the lm_head (model.norm); the norm weights become 1.
2. A weightless RMSNorm commutes with an orthogonal R [D, D] (‖xR‖ = ‖x‖), so the whole stream can be carried
   rotated, x ← xR:  the embedding's rows E ← E·R; readers W ← W·R (q/k/v, gate/up, lm_head: W [Dout, D]);
   writers W ← Rᵀ·W (o, down: W [D, Din]).

Optionally each attention head's values are rotated too, v ← v·Rv with Rv [E, E] (one for all heads): v_proj's
row block of every kv head ← Rvᵀ·block, o_proj's column block of every query head ← block·Rv. down_proj's input
(silu(gate)·up) is left alone: rotating it would need a rotation at run time.

The lm_head stops being the embedding: it is E·diag(g)·R, the embedding E·R, so a tied model comes out with its own
lm_head.weight (tie_word_embeddings false). Everything else is an ordinary Llama checkpoint with unit norm weights.

R is a randomized Hadamard matrix H·diag(±1)/√p where D is a power of two p, and otherwise the Kronecker product of
a random orthogonal [m, m] (Haar, from a QR) with one for the largest power of two p dividing D = m·p
(SmolLM2's 576 = 9·64). Each spreads any single channel's weight over all D (incoherence), which is what lets a
per-row or per-group grid fit the rows without a few large columns setting the scale.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from refimpl.model.config import LlamaConfig
from refimpl.quant.apply import LM_HEAD, source_weight
from refimpl.quant.calibrate import NORMS, SHARED_INPUT
from refimpl.quant.formats import F32, QuantError

ROTATION_SEED = 0  # `llama32 quantize --rotate`'s
NORM_READERS = {norm: SHARED_INPUT[act] for act, norm in NORMS.items()}  # [Dout, D]: read the (normed) stream
READERS = tuple(key for keys in NORM_READERS.values() for key in keys)
WRITERS = SHARED_INPUT["attn.out"] + SHARED_INPUT["mlp.act"]  # [D, Din]: add to the stream


def hadamard(p: int) -> np.ndarray:
    """Sylvester's Hadamard matrix scaled to be orthogonal, [p, p] for p a power of two."""
    if p < 1 or p & (p - 1):
        raise ValueError(f"hadamard: {p} is not a power of two")
    h = np.ones((1, 1))
    while len(h) < p:
        h = np.block([[h, h], [h, -h]])  # [n, n] -> [2n, 2n]
    return h / np.sqrt(p)


def random_orthogonal(m: int, rng: np.random.Generator) -> np.ndarray:
    """A Haar-random orthogonal [m, m]: Q of a Gaussian matrix's QR, its columns' signs fixed by R's diagonal."""
    q, r = np.linalg.qr(rng.standard_normal((m, m)))
    return q * np.sign(np.diag(r))[None, :]


def rotation(d: int, seed: int = 0) -> np.ndarray:
    """An orthogonal [d, d]: kron(random orthogonal [m, m], randomized Hadamard [p, p]) for d = m·p, p the largest
    power of two dividing d (m = 1: the randomized Hadamard alone)."""
    rng = np.random.default_rng(seed)
    p = d & -d  # the largest power of two dividing d
    signed = hadamard(p) * rng.choice([-1.0, 1.0], p)[:, None]  # diag(±1)·H: rows' signs flipped
    m = d // p
    return signed if m == 1 else np.kron(random_orthogonal(m, rng), signed)  # [m·p, m·p]


def fold_norms(params: dict, cfg: LlamaConfig) -> dict:
    """Every RMSNorm weight folded into the matrices reading its output (W·diag(g)); the norms become 1 and the
    lm_head its own tensor. The same function in exact arithmetic."""
    out = dict(params)
    for i in range(cfg.num_hidden_layers):
        for norm, readers in NORM_READERS.items():
            g = params[f"model.layers.{i}.{norm}"]  # [D]
            for key in readers:
                out[f"model.layers.{i}.{key}"] = params[f"model.layers.{i}.{key}"] * g  # [Dout, D] * [D]
            out[f"model.layers.{i}.{norm}"] = np.ones_like(g)
    out[LM_HEAD] = source_weight(params, LM_HEAD) * params["model.norm.weight"]  # [V, D] * [D]
    out["model.norm.weight"] = np.ones_like(params["model.norm.weight"])
    return out


def rotate_stream(params: dict, cfg: LlamaConfig, r: np.ndarray) -> dict:
    """Norm-folded params (fold_norms) and an orthogonal r [D, D] -> the model that carries the stream as x·r."""
    r = np.asarray(r, np.float64)
    out = dict(params)
    for name in ("model.embed_tokens.weight", LM_HEAD):
        out[name] = (params[name] @ r).astype(F32)  # [V, D] @ [D, D]
    for i in range(cfg.num_hidden_layers):
        for key in READERS:
            out[f"model.layers.{i}.{key}"] = (params[f"model.layers.{i}.{key}"] @ r).astype(F32)  # [Dout, D] @ [D, D]
        for key in WRITERS:
            out[f"model.layers.{i}.{key}"] = (r.T @ params[f"model.layers.{i}.{key}"]).astype(F32)  # [D, D] @ [D, Din]
    return out


def rotate_values(params: dict, cfg: LlamaConfig, rv: np.ndarray) -> dict:
    """Every head's value vector carried as v·rv (rv [E, E] orthogonal): v_proj's kv-head blocks ← rvᵀ·block,
    o_proj's query-head column blocks ← block·rv. Attention mixes v over positions only, so this is exact."""
    rv = np.asarray(rv, np.float64)
    K, H, E, D = cfg.num_key_value_heads, cfg.num_attention_heads, cfg.head_dim, cfg.hidden_size
    out = dict(params)
    for i in range(cfg.num_hidden_layers):
        v = params[f"model.layers.{i}.self_attn.v_proj.weight"].reshape(K, E, D)  # [K·E, D] -> [K, E, D]
        v = rv.T @ v  # [E, E] @ [K, E, D] -> [K, E, D]: rvᵀ times each kv head's block
        out[f"model.layers.{i}.self_attn.v_proj.weight"] = v.reshape(K * E, D).astype(F32)  # -> [K·E, D]
        o = params[f"model.layers.{i}.self_attn.o_proj.weight"].reshape(D, H, E)  # [D, H·E] -> [D, H, E]
        out[f"model.layers.{i}.self_attn.o_proj.weight"] = (o @ rv).reshape(D, H * E).astype(F32)  # [D, H, E] @ [E, E]
    return out


def rotate_model(params: dict, cfg: LlamaConfig, seed: int = 0, values: bool = True) -> tuple[dict, LlamaConfig]:
    """fp32 params -> (norm-folded, stream-rotated (and value-rotated) params, the config with an untied head).
    The rotated model computes the same logits as the original up to fp32 rounding."""
    coded = [k for k, v in params.items() if not isinstance(v, np.ndarray)]
    if coded:  # e.g. QuantizedLinear records: rotating their codes would need dequantizing first
        raise QuantError(f"rotate: {coded[0]} is a {type(params[coded[0]]).__name__}, expected a float array "
                         "(rotate the original checkpoint, before quantizing)")
    out = rotate_stream(fold_norms(params, cfg), cfg, rotation(cfg.hidden_size, seed))
    if values:
        out = rotate_values(out, cfg, rotation(cfg.head_dim, seed + 1))
    return out, dataclasses.replace(cfg, tie_word_embeddings=False)
