"""Residual-stream rotation before quantizing (QuaRot / SpinQuant style): the same function, new weights that an
axis-aligned quantization grid serves better.

A Llama block reads the residual stream x [T, D] only through an RMSNorm followed by linear layers, and writes it
only through o_proj and down_proj. This holds for the bias-free Llama this package runs (config_fields refuses
attention_bias / mlp_bias, LlamaConfig any model_type but llama); a bias would need rotating too, so rotate_model
refuses any tensor other than a Llama's. Two exact rewrites, both done once on the weights, make the stream free
to rotate:

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

from refimpl.formats.params import expected_shapes
from refimpl.model.config import LlamaConfig
from refimpl.progress import Progress
from refimpl.quant.apply import LM_HEAD, NORMS, SHARED_INPUT, source_weight
from refimpl.errors import QuantError
from refimpl.quant.schemes import F32

ROTATION_SEED = 0  # `llama32 quantize --rotate`'s
CONSTRUCTION = "hadamard-kron-haar"  # rotation()'s: with it a seed pins R; rename it when rotation() changes
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


def record(seed: int, values: bool) -> dict:
    """What a checkpoint records of rotate_model(params, cfg, seed, values): enough to rebuild R and Rv."""
    return {"residual": True, "values": values, "seed": seed, "construction": CONSTRUCTION}


def value_rows(v: np.ndarray, rv: np.ndarray, K: int) -> np.ndarray:
    """v_proj [K·E, D] with every kv head's row block ← rvᵀ·block (its values come out as v·rv)."""
    E, D = rv.shape[0], v.shape[1]
    return (rv.T @ v.reshape(K, E, D)).reshape(K * E, D)  # [E, E] @ [K, E, D] -> [K, E, D] -> [K·E, D]


def value_columns(o: np.ndarray, rv: np.ndarray, H: int) -> np.ndarray:
    """o_proj [D, H·E] with every query head's column block ← block·rv (it reads v·rv)."""
    D, E = o.shape[0], rv.shape[0]
    return (o.reshape(D, H, E) @ rv).reshape(D, H * E)  # [D, H, E] @ [E, E] -> [D, H, E] -> [D, H·E]


def _check_plain(params: dict, cfg: LlamaConfig) -> None:
    """Float arrays, and exactly a bias-free Llama's tensors (a `*.bias` would need rotating too)."""
    known = set(expected_shapes(cfg)) | {LM_HEAD}
    other = [k for k in params if k not in known]
    if other:
        raise QuantError(f"rotate: {other[0]} is not a tensor of a bias-free Llama; cannot rotate it")
    coded = [k for k, v in params.items() if not isinstance(v, np.ndarray)]
    if coded:  # e.g. QuantizedLinear records: rotating their codes would need dequantizing first
        raise QuantError(f"rotate: {coded[0]} is a {type(params[coded[0]]).__name__}, expected a float array "
                         "(rotate the original checkpoint, before quantizing)")


def rotate_model(params: dict, cfg: LlamaConfig, seed: int = 0, values: bool = True) -> tuple[dict, LlamaConfig]:
    """fp32 params -> (norm-folded, stream-rotated (and value-rotated) params, the config with an untied head).
    The rotated model computes the same logits as the original up to fp32 rounding.

    One pass, one new tensor at a time: each matrix is folded and rotated in a single product with diag(g)·r
    (r in fp32, the weights' dtype), so the host holds the source and the result, no intermediate model."""
    _check_plain(params, cfg)
    H, K = cfg.num_attention_heads, cfg.num_key_value_heads
    r = rotation(cfg.hidden_size, seed).astype(F32)  # [D, D]
    rv = rotation(cfg.head_dim, seed + 1).astype(F32) if values else None  # [E, E]
    out = dict.fromkeys(params)  # the source's order; every entry replaced below
    out["model.embed_tokens.weight"] = params["model.embed_tokens.weight"] @ r  # [V, D] @ [D, D]
    with Progress(f"rotating {cfg.num_hidden_layers} layers", cfg.num_hidden_layers) as bar:
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            for norm, readers in NORM_READERS.items():
                gr = params[p + norm][:, None] * r  # diag(g)·r [D, D]: the norm's weight folded into the rotation
                for key in readers:
                    out[p + key] = params[p + key] @ gr  # [Dout, D] @ [D, D]
                out[p + norm] = np.ones_like(params[p + norm])
            for key in WRITERS:
                out[p + key] = r.T @ params[p + key]  # [D, D] @ [D, Din]
            if values:
                v, o = p + "self_attn.v_proj.weight", p + "self_attn.o_proj.weight"
                out[v], out[o] = value_rows(out[v], rv, K), value_columns(out[o], rv, H)
            bar.advance()
    norm = params["model.norm.weight"]
    out[LM_HEAD] = source_weight(params, LM_HEAD) @ (norm[:, None] * r)  # [V, D] @ [D, D]
    out["model.norm.weight"] = np.ones_like(norm)
    return out, dataclasses.replace(cfg, tie_word_embeddings=False)
