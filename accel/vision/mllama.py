"""The fast Llama 3.2 Vision text forward: prefill (whole prompt) and the one-token decode step.

Same computation as refimpl.model.mllama.forward (trace mode runs that one over accel.ops), arranged like
accel.model: the self-attention layers are accel.model's (fused GEMMs, RoPE in the cache write, flash attention,
the decode GEMVs carrying their neighbours); the cross-attention layers
    * read image keys/values computed once per request (`write_image_kv`) into their own static buffers
      xk/xv [C, K, N, E] (C cross layers, N = images × tiles × tokens per tile);
    * attend through torch SDPA with the cross-attention mask, the query heads of one kv head folded into the
      query rows (no causal structure to keep), so no head is repeated in memory;
    * in the decode step read the prompt's last mask row and "row sees an image" flag from device buffers, so
      the step stays capturable in the CUDA graph.
A prompt without an image skips the cross layers entirely: no work, no image buffers.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from refimpl.model.mllama import TEXT, MllamaCache, cross_attention_rows
from refimpl.model.mllama_config import MllamaConfig

from .. import ops
from ..kernels.tuning import DEFAULT, Tuning
from ..model import RopeTables, decode_layer, self_layer
from .weights import MllamaWeights, self_layer_config


@dataclass
class MllamaStaticCache(MllamaCache):
    """MllamaCache (trace mode reads k/v/xk/xv by layer index) over preallocated tensors for the fast path."""

    k_all: torch.Tensor = None  # [Ls, K, S, E], self-attention layers in order; k[i] are views
    v_all: torch.Tensor = None
    tables: RopeTables = None
    xk_all: torch.Tensor | None = None  # [C, K, N, E], None without an image; xk[i] are views
    xv_all: torch.Tensor | None = None
    decode_visible: torch.Tensor | None = None  # [N] bool: what generated tokens see (the prompt's last row)
    decode_has_image: torch.Tensor | None = None  # [1, 1] model dtype: 0 zeroes the cross layers' MLP branch


def cross_attend(q, xk, xv, visible):
    """q [T, H, E] over xk/xv [K, N, E] with visible [T, N] bool -> [T, H, E], SDPA (fp32 softmax inside)."""
    T, H, E = q.shape
    K = xk.shape[0]
    G = H // K
    qg = q.view(T, K, G, E).permute(1, 2, 0, 3).reshape(1, K, G * T, E)  # head k·G+g, row g·T+t
    mask = visible.repeat(G, 1)[None, None]  # [T, N] -> [1, 1, G·T, N]
    out = F.scaled_dot_product_attention(qg, xk[None], xv[None], attn_mask=mask)  # [1, K, G·T, E]
    return out.view(K, G, T, E).permute(2, 0, 1, 3).reshape(T, H, E)


def _cross(p: dict, i: int):
    return lambda key: p[f"{TEXT}layers.{i}.{key}"]


def write_image_kv(w: MllamaWeights, cfg: MllamaConfig, states, cache: MllamaStaticCache) -> None:
    """The image tokens states [N, D] -> every cross layer's normed keys and values, into cache.xk_all/xv_all."""
    t = cfg.text
    N, K, E = states.shape[0], t.num_key_value_heads, t.head_dim
    for c, i in enumerate(t.cross_attention_layers):
        p = _cross(w.params, i)
        k = ops.rms_norm(F.linear(states, p("cross_attn.k_proj.weight")).view(N, K, E), p("cross_attn.k_norm.weight"),
                         t.rms_norm_eps)  # [N, D] -> [N, K, E]
        cache.xk_all[c].copy_(k.transpose(0, 1))  # -> [K, N, E]
        cache.xv_all[c].copy_(F.linear(states, p("cross_attn.v_proj.weight")).view(N, K, E).transpose(0, 1))


def _cross_layer(p, cfg, x, h, next_norm, xk, xv, visible, has_image):
    """One cross-attention layer over x [T, D] and h = its input norm -> (x, next_norm(x)); has_image [T, 1]."""
    T, H, E, eps = x.shape[0], cfg.num_attention_heads, cfg.head_dim, cfg.rms_norm_eps
    q = ops.rms_norm(ops.linear(h, p("cross_attn.q_proj.weight")).view(T, H, E), p("cross_attn.q_norm.weight"), eps)
    a = cross_attend(q, xk, xv, visible)  # [T, H, E]
    o = ops.linear(a.reshape(T, H * E), p("cross_attn.o_proj.weight"))  # [T, H·E] -> [T, D]
    x, h = ops.add_rms_norm(p("cross_attn_attn_gate").tanh() * o, x, p("post_attention_layernorm.weight"), eps)
    act = ops.swiglu(ops.linear(h, p("mlp.gate_proj.weight")), ops.linear(h, p("mlp.up_proj.weight")))
    down = ops.linear(act, p("mlp.down_proj.weight")) * has_image  # full_text_row_masked_out_mask
    return ops.add_rms_norm(p("cross_attn_mlp_gate").tanh() * down, x, next_norm, eps)


def _schedule(w: MllamaWeights, cfg: MllamaConfig, has_image: bool):
    """[(layer index, self-layer slot or None for a cross layer, cross slot, next norm weight)] of the layers
    that run; the cross layers only with an image."""
    t = cfg.text
    run = [i for i in range(t.num_hidden_layers) if has_image or i not in t.cross_attention_layers]
    slot = {i: j for j, i in enumerate(w.self_layers)}
    cross = {i: c for c, i in enumerate(t.cross_attention_layers)}
    norms = [w.params[f"{TEXT}layers.{i}.input_layernorm.weight"] for i in run] + [w.params[TEXT + "norm.weight"]]
    return [(i, slot.get(i), cross.get(i), norms[n + 1]) for n, i in enumerate(run)], norms[0]


def prefill(w: MllamaWeights, cfg: MllamaConfig, ids, cache: MllamaStaticCache):
    """ids [T] on the device, the prompt at positions 0..T-1 (the image K/V already written when it has one)
    -> last-token logits [1, V]; fills the self-attention caches and the decode step's mask buffers."""
    t, sub = cfg.text, self_layer_config(cfg)
    T = ids.shape[0]
    positions = torch.arange(T, device=ids.device)
    cos, sin = cache.tables.cos[:T], cache.tables.sin[:T]
    x = ops.embedding(ids, w.params[TEXT + "embed_tokens.weight"])  # [T, D]
    if cache.has_image:
        visible, row_has = cross_attention_rows(cache, np.arange(T), cfg.vision.tokens_per_tile, cache.image_tokens)
        visible = torch.as_tensor(visible | ~row_has[:, None], device=x.device)  # [T, N]
        has = torch.as_tensor(row_has, device=x.device).to(x.dtype)[:, None]  # [T, 1]
        cache.decode_visible.copy_(visible[-1])
        cache.decode_has_image.copy_(has[-1:])
    layers, first_norm = _schedule(w, cfg, cache.has_image)
    h = ops.rms_norm(x, first_norm, t.rms_norm_eps)
    for i, j, c, next_norm in layers:
        if j is not None:
            x, h = self_layer(w.text.layers[j], sub, x, h, next_norm, cos, sin, cache.k_all[j], cache.v_all[j],
                              positions, lambda q, j=j: ops.causal_attention(q, cache.k_all[j], cache.v_all[j],
                                                                             positions))
        else:
            x, h = _cross_layer(_cross(w.params, i), t, x, h, next_norm, cache.xk_all[c], cache.xv_all[c],
                                visible, has)
    return ops.linear(h[-1:], w.text.lm_head)  # [1, D] -> [1, V]


def decode_step(w: MllamaWeights, cfg: MllamaConfig, token, position, cache: MllamaStaticCache,
                tuning: Tuning = DEFAULT):
    """token [1], position [1] (device) -> logits [1, V]. Capturable in a CUDA graph: the image buffers and the
    mask row are static tensors of the cache."""
    t, sub = cfg.text, self_layer_config(cfg)
    eps = t.rms_norm_eps
    H, E = t.num_attention_heads, t.head_dim
    cos, sin = cache.tables.cos, cache.tables.sin
    x = ops.embedding(token, w.params[TEXT + "embed_tokens.weight"])  # [1, D], updated in place by self layers
    layers, _ = _schedule(w, cfg, cache.has_image)
    for i, j, c, _next in layers:
        if j is not None:
            decode_layer(w.text.layers[j], sub, x, position, cos, sin, cache.k_all[j], cache.v_all[j], tuning)
            continue
        p = _cross(w.params, i)
        h = ops.rms_norm(x, p("input_layernorm.weight"), eps)
        q = ops.rms_norm(ops.linear(h, p("cross_attn.q_proj.weight")).view(1, H, E), p("cross_attn.q_norm.weight"),
                         eps)
        a = cross_attend(q, cache.xk_all[c], cache.xv_all[c], cache.decode_visible[None])  # [1, H, E]
        o = ops.linear(a.reshape(1, H * E), p("cross_attn.o_proj.weight"))  # [1, D]
        x += p("cross_attn_attn_gate").tanh() * o
        h = ops.rms_norm(x, p("post_attention_layernorm.weight"), eps)
        act = ops.swiglu(ops.linear(h, p("mlp.gate_proj.weight")), ops.linear(h, p("mlp.up_proj.weight")))
        x += p("cross_attn_mlp_gate").tanh() * (ops.linear(act, p("mlp.down_proj.weight")) * cache.decode_has_image)
    return ops.norm_linear(x, w.params[TEXT + "norm.weight"], w.text.lm_head, eps, tuning)  # [1, D] -> [1, V]
