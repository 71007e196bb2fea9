"""The fast Llama 3.2 Vision text forward: prefill (whole prompt) and the one-token decode step.

Same computation as refimpl.model.llama_vision.forward (trace mode runs that one over accel.ops), arranged like
accel.model: the self-attention layers are accel.model's (fused GEMMs, RoPE in the cache write, flash attention,
the decode GEMVs carrying their neighbours); the cross-attention layers
    * read image keys/values computed once per request (`write_image_kv`) into their own static buffers
      xk/xv [C, K, N, E] (C cross layers, N = images × tiles × tokens per tile);
    * attend with `ops.norm_cross_attention` (q_norm fused in; prefill: flash attention without the causal mask,
      the decode step: split along the image tokens), the mask built once per request;
    * in the decode step run as a self layer does, 5 launches: norm + q GEMV, attention, o GEMV + gated residual,
      norm + gate_up GEMV, SwiGLU + down GEMV + gated residual. The tanh gates (the MLP's times the prompt's last
      "row sees an image" flag) and the mask row are device buffers written by the prefill, so the step stays
      capturable in the CUDA graph.
A prompt without an image skips the cross layers entirely: no work, no image buffers.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from refimpl.model.llama_vision import TEXT, VisionCache, cross_attention_rows
from refimpl.model.vision_config import MllamaConfig

from .. import ops
from ..kernels.tuning import DEFAULT, Tuning
from ..model import RopeTables, decode_layer, self_layer
from . import encoder
from .weights import CrossLayer, VisionWeights, self_layer_config


@dataclass
class VisionStaticCache(VisionCache):
    """VisionCache (trace mode reads k/v/xk/xv by layer index) over preallocated tensors for the fast path."""

    k_all: torch.Tensor = None  # [Ls, K, S, E], self-attention layers in order; k[i] are views
    v_all: torch.Tensor = None
    tables: RopeTables = None
    xk_all: torch.Tensor | None = None  # [C, K, N, E], None without an image; xk[i] are views
    xv_all: torch.Tensor | None = None
    decode_visible: torch.Tensor | None = None  # [1, N] bool: what generated tokens see (the prompt's last row)
    decode_gates: torch.Tensor | None = None  # [C, 2] model dtype: tanh(attn gate), tanh(mlp gate) · row has image


def write_image_kv(w: VisionWeights, cfg: MllamaConfig, states, cache: VisionStaticCache) -> None:
    """The image tokens states [N, D] -> every cross layer's normed keys and values, into cache.xk_all/xv_all:
    two GEMMs over all C layers' fused weights, one RMSNorm launch over every layer's key rows."""
    t, kv = cfg.text, w.image_kv
    N, K, E, C = states.shape[0], t.num_key_value_heads, t.head_dim, len(t.cross_attention_layers)
    # RMSNorm with a unit weight gives the normed keys already rounded to the model dtype, as HF's k_norm casts
    # them before its weight; the per-layer weight then multiplies in the transposing write: HF's result exactly
    k = ops.rms_norm(F.linear(states, kv.k).view(N * C * K, E), kv.ones, t.rms_norm_eps)  # [N, D] -> [N·C·K, E]
    torch.mul(k.view(N, C, K, E).permute(1, 2, 0, 3), kv.k_norm[:, None, None, :], out=cache.xk_all)  # [C, K, N, E]
    cache.xv_all.copy_(F.linear(states, kv.v).view(N, C, K, E).permute(1, 2, 0, 3))  # [N, C·K·E] -> [C, K, N, E]


def encode_image_kv(w: VisionWeights, cfg: MllamaConfig, images, cache) -> None:
    """A request's images (ImageInputs with pixel_values and aspect_ratio_ids as device tensors) -> encoder,
    projector, then every cross layer's image keys/values into cache.xk_all/xv_all [C, K, N, E]."""
    features = encoder.encode(w.params, cfg.vision, images.pixel_values, images.aspect_ratio_ids,
                              images.aspect_ratio_mask, w.vision_qkv, w.vision_gates)  # [I, A, P, O]
    write_image_kv(w, cfg, encoder.project(w.params, features), cache)


def cross_layer(cl: CrossLayer, cfg, x, h, next_norm, xk, xv, visible, has_image):
    """One cross-attention layer over x [T, D] and h = its input norm -> (x, next_norm(x)); visible [T, N] (rows
    that may see no tile see every image token, as HF's masking makes them), has_image [T, 1]."""
    def attend(q):  # [T, H, E] -> [T, H, E]
        return ops.norm_cross_attention(q, cl.q_norm, cfg.rms_norm_eps, xk, xv, visible)
    return gated_cross_layer(cl, cfg, x, h, next_norm, has_image, attend)


def gated_cross_layer(cl: CrossLayer, cfg, x, h, next_norm, has_image, attend):
    """cross_layer with its attention given: attend(q [T, H, E]) -> the q-normed attention over the image tokens
    each row sees [T, H, E] (the batched engine's rows attend to their own request's images)."""
    T, H, E, eps = x.shape[0], cfg.num_attention_heads, cfg.head_dim, cfg.rms_norm_eps
    q = ops.linear(h, cl.q).view(T, H, E)  # [T, D] -> [T, H, E]
    a = attend(q)  # [T, H, E]
    o = ops.linear(a.reshape(T, H * E), cl.o)  # [T, H·E] -> [T, D]
    x, h = ops.add_rms_norm(cl.attn_gate.tanh() * o, x, cl.mlp_norm, eps)
    act = ops.swiglu_gate_up(ops.linear(h, cl.gate_up))  # [T, D] -> [T, 2F] -> [T, F]
    down = ops.linear(act, cl.down) * has_image  # full_text_row_masked_out_mask
    return ops.add_rms_norm(cl.mlp_gate.tanh() * down, x, next_norm, eps)


def _schedule(w: VisionWeights, cfg: MllamaConfig, has_image: bool):
    """[(layer index, self-layer slot or None for a cross layer, cross slot, next norm weight)] of the layers
    that run; the cross layers only with an image."""
    t = cfg.text
    run = [i for i in range(t.num_hidden_layers) if has_image or i not in t.cross_attention_layers]
    slot = {i: j for j, i in enumerate(w.self_layers)}
    cross = {i: c for c, i in enumerate(t.cross_attention_layers)}
    norms = [w.params[f"{TEXT}layers.{i}.input_layernorm.weight"] for i in run] + [w.params[TEXT + "norm.weight"]]
    return [(i, slot.get(i), cross.get(i), norms[n + 1]) for n, i in enumerate(run)], norms[0]


def _request_masks(w: VisionWeights, cfg: MllamaConfig, T: int, cache: VisionStaticCache, device):
    """The prompt's cross-attention mask (visible [T, N] bool, rows before the first image seeing every image
    token, as HF's masking makes them) and row-has-image [T, 1]; also the decode step's mask row and gates."""
    visible, row_has = cross_attention_rows(cache, np.arange(T), cfg.vision.tokens_per_tile, cache.image_tokens)
    visible = torch.as_tensor(visible | ~row_has[:, None]).to(device)  # [T, N]
    has = torch.as_tensor(row_has).to(device).to(cache.xk_all.dtype)[:, None]  # [T, 1]
    cache.decode_visible.copy_(visible[-1:])
    for c, cl in enumerate(w.cross):  # the MLP branch of a token whose row sees no image is zeroed
        cache.decode_gates[c, 0:1].copy_(cl.attn_gate.tanh())
        cache.decode_gates[c, 1:2].copy_(cl.mlp_gate.tanh() * has[-1])
    return visible, has


def prefill(w: VisionWeights, cfg: MllamaConfig, ids, cache: VisionStaticCache):
    """ids [T] on the device, the prompt at positions 0..T-1 (the image K/V already written when it has one)
    -> last-token logits [1, V]; fills the self-attention caches and the decode step's mask and gate buffers."""
    t, sub = cfg.text, self_layer_config(cfg)
    T = ids.shape[0]
    positions = torch.arange(T, device=ids.device)
    cos, sin = cache.tables.cos[:T], cache.tables.sin[:T]
    x = ops.embedding(ids, w.params[TEXT + "embed_tokens.weight"])  # [T, D]
    if cache.has_image:
        visible, has = _request_masks(w, cfg, T, cache, x.device)
    layers, first_norm = _schedule(w, cfg, cache.has_image)
    h = ops.rms_norm(x, first_norm, t.rms_norm_eps)
    for i, j, c, next_norm in layers:
        if j is not None:
            x, h = self_layer(w.text.layers[j], sub, x, h, next_norm, cos, sin, cache.k_all[j], cache.v_all[j],
                              positions)
        else:
            x, h = cross_layer(w.cross[c], t, x, h, next_norm, cache.xk_all[c], cache.xv_all[c], visible, has)
    return ops.linear(h[-1:], w.text.lm_head)  # [1, D] -> [1, V]


def decode_step(w: VisionWeights, cfg: MllamaConfig, token, position, cache: VisionStaticCache,
                tuning: Tuning = DEFAULT):
    """token [1], position [1] (device) -> logits [1, V]. Capturable in a CUDA graph: the image buffers, the mask
    row and the gates are static tensors of the cache."""
    t, sub = cfg.text, self_layer_config(cfg)
    cos, sin = cache.tables.cos, cache.tables.sin
    x = ops.embedding(token, w.params[TEXT + "embed_tokens.weight"])  # [1, D], updated in place by every layer
    layers, _ = _schedule(w, cfg, cache.has_image)
    for i, j, c, _next in layers:
        if j is not None:
            decode_layer(w.text.layers[j], sub, x, position, cos, sin, cache.k_all[j], cache.v_all[j], tuning)
        else:
            cross_decode_layer(w.cross[c], t, x, cache.xk_all[c], cache.xv_all[c], cache.decode_visible,
                               cache.decode_gates[c], tuning)
    return ops.norm_linear(x, w.params[TEXT + "norm.weight"], w.text.lm_head, t.rms_norm_eps, tuning)  # [1, V]


def cross_decode_layer(cl: CrossLayer, cfg, x, xk, xv, visible, gates, tuning: Tuning = DEFAULT):
    """One cross-attention layer of the decode step, updating x [1, D] in place (5 launches, as a self layer);
    visible [1, N], gates [2] (decode_gates' row)."""
    H, E, eps = cfg.num_attention_heads, cfg.head_dim, cfg.rms_norm_eps
    q = ops.norm_linear(x, cl.attn_norm, cl.q, eps, tuning).view(1, H, E)  # [1, D] -> [1, H, E]
    a = ops.norm_cross_attention(q, cl.q_norm, eps, xk, xv, visible, tuning)  # [1, H, E]
    ops.linear_add(a.reshape(1, H * E), cl.o, x, tuning, gate=gates[0:1])  # x += tanh(g)·o(a): resid_mid
    gate_up = ops.norm_linear(x, cl.mlp_norm, cl.gate_up, eps, tuning)  # [1, D] -> [1, 2F]
    ops.swiglu_linear_add(gate_up, cl.down, x, tuning, gate=gates[1:2])  # x += tanh(g)·has·down(...): resid_post
