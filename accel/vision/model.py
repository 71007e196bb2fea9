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

from refimpl.model import ops as np_ops
from refimpl.model.llama_vision import TEXT, VisionCache, cross_attention_rows
from refimpl.model.vision_config import MllamaConfig

from .. import ops
from ..kernels.tuning import DEFAULT, Tuning
from ..model import WHOLE, RopeTables, decode_layer, self_layer
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

    @classmethod
    def allocate(cls, t, capacity: int, image_tokens: int, dtype, device) -> "VisionStaticCache":
        """Zeroed caches for text config t (a tensor-parallel rank's local one: its KV heads): the self layers'
        k/v [Ls, K, S, E] with RoPE tables for `capacity` positions; with image_tokens N, the image keys/values
        [C, K, N, E] and the decode step's mask row and gates."""
        K, E, C = t.num_key_value_heads, t.head_dim, len(t.cross_attention_layers)
        self_layers = [i for i in range(t.num_hidden_layers) if i not in t.cross_attention_layers]
        k_all = torch.zeros((len(self_layers), K, capacity, E), dtype=dtype, device=device)  # [Ls, K, S, E]
        v_all = torch.zeros_like(k_all)
        cos, sin = np_ops.rope_tables(np.arange(capacity), E, t.rope_theta, t.rope_scaling)
        tables = RopeTables(torch.from_numpy(cos).to(device), torch.from_numpy(sin).to(device))
        cache = cls(dict(zip(self_layers, k_all.unbind(0))), dict(zip(self_layers, v_all.unbind(0))), capacity,
                    k_all=k_all, v_all=v_all, tables=tables)
        if image_tokens:
            cache.xk_all = torch.zeros((C, K, image_tokens, E), dtype=dtype, device=device)  # [C, K, N, E]
            cache.xv_all = torch.zeros_like(cache.xk_all)
            cache.xk = dict(zip(t.cross_attention_layers, cache.xk_all.unbind(0)))
            cache.xv = dict(zip(t.cross_attention_layers, cache.xv_all.unbind(0)))
            cache.decode_visible = torch.ones((1, image_tokens), dtype=torch.bool, device=device)
            cache.decode_gates = torch.zeros((C, 2), dtype=dtype, device=device)
        return cache


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


def layer_slots(t, has_image: bool) -> list[tuple[int, int | None, int | None]]:
    """[(layer index, self-layer slot or None, cross slot or None)] of the layers that run, for text config t;
    the cross layers only with an image."""
    self_layers = [i for i in range(t.num_hidden_layers) if i not in t.cross_attention_layers]
    slot = {i: j for j, i in enumerate(self_layers)}
    cross = {i: c for c, i in enumerate(t.cross_attention_layers)}
    return [(i, slot.get(i), cross.get(i)) for i in range(t.num_hidden_layers) if has_image or i in slot]


def request_masks(cross: list[CrossLayer], cfg: MllamaConfig, positions, cache: VisionStaticCache, device):
    """The cross-attention mask of the queries at positions [T] (host ints): visible [T, N] bool (rows that may
    see no tile see every image token, as HF's masking makes them) and row-has-image [T, 1]; also the decode
    step's mask row and gates, the last position's (a prompt's last row is every generated token's)."""
    visible, row_has = cross_attention_rows(cache, positions, cfg.vision.tokens_per_tile, cache.image_tokens)
    visible = torch.as_tensor(visible | ~row_has[:, None]).to(device)  # [T, N]
    has = torch.as_tensor(row_has).to(device).to(cache.xk_all.dtype)[:, None]  # [T, 1]
    cache.decode_visible.copy_(visible[-1:])
    for c, cl in enumerate(cross):  # the MLP branch of a token whose row sees no image is zeroed
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
    x = ops.embedding(ids, w.text.embed)  # [T, D]
    if cache.has_image:
        visible, has = request_masks(w.cross, cfg, np.arange(T), cache, x.device)
    layers = layer_slots(t, cache.has_image)
    norms = [w.params[f"{TEXT}layers.{i}.input_layernorm.weight"] for i, _, _ in layers] + [w.text.norm]
    h = ops.rms_norm(x, norms[0], t.rms_norm_eps)
    for (i, j, c), next_norm in zip(layers, norms[1:]):
        if j is not None:
            x, h = self_layer(w.text.layers[j], sub, x, h, next_norm, cos, sin, cache.k_all[j], cache.v_all[j],
                              positions)
        else:
            x, h = cross_layer(w.cross[c], t, x, h, next_norm, cache.xk_all[c], cache.xv_all[c], visible, has)
    return ops.linear(h[-1:], w.text.lm_head)  # [1, D] -> [1, V]


def decode_step(w: VisionWeights, cfg: MllamaConfig, token, position, cache: VisionStaticCache,
                tuning: Tuning = DEFAULT, split=WHOLE):
    """token [1], position [1] (device) -> logits [1, V]. Capturable in a CUDA graph: the image buffers, the mask
    row and the gates are static tensors of the cache. split: WHOLE, or one tensor-parallel rank's part
    (accel.tp.model.RankSplit, as accel.model.decode_step's: w is then the rank's shard, accel.tp.vision_load's
    TPVisionWeights, and cfg.text its local config)."""
    t, sub = cfg.text, self_layer_config(cfg)
    cos, sin = cache.tables.cos, cache.tables.sin
    x = split.embedding(token, w.text.embed)  # [1, D], updated in place by every layer
    for i, j, c in layer_slots(t, cache.has_image):
        if j is not None:
            decode_layer(w.text.layers[j], sub, x, position, cos, sin, cache.k_all[j], cache.v_all[j], tuning, split)
        else:
            cross_decode_layer(w.cross[c], t, x, cache.xk_all[c], cache.xv_all[c], cache.decode_visible,
                               cache.decode_gates[c], tuning, split)
    return split.gather(ops.norm_linear(x, w.text.norm, w.text.lm_head, t.rms_norm_eps, tuning))  # [1, V]


def cross_decode_layer(cl: CrossLayer, cfg, x, xk, xv, visible, gates, tuning: Tuning = DEFAULT, split=WHOLE):
    """One cross-attention layer of the decode step, updating x [1, D] in place (5 launches, as a self layer);
    visible [1, N], gates [2] (decode_gates' row). Split over ranks as accel.model.decode_layer is: the owner of
    the residual stream adds its gated o/down partial sums, the others overwrite x with theirs, split.reduce sums
    x over the ranks (x + tanh(g)·Σ partials: the gate is linear)."""
    H, E, eps, add = cfg.num_attention_heads, cfg.head_dim, cfg.rms_norm_eps, split.owner
    q = ops.norm_linear(x, cl.attn_norm, cl.q, eps, tuning).view(1, H, E)  # [1, D] -> [1, H, E]
    a = ops.norm_cross_attention(q, cl.q_norm, eps, xk, xv, visible, tuning)  # [1, H, E]
    ops.linear_add(a.reshape(1, H * E), cl.o, x, tuning, gate=gates[0:1], accumulate=add)  # x += tanh(g)·o(a)
    split.reduce(x)  # resid_mid
    gate_up = ops.norm_linear(x, cl.mlp_norm, cl.gate_up, eps, tuning)  # [1, D] -> [1, 2F]
    ops.swiglu_linear_add(gate_up, cl.down, x, tuning, gate=gates[1:2], accumulate=add)  # x += tanh(g)·has·down
    split.reduce(x)  # resid_post
