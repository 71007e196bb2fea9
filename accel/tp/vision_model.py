"""One rank's Llama 3.2 Vision forward over its shard (accel.tp.vision_load), with Megatron's collectives.

The self layers are accel.tp.model's. A cross layer on the residual stream x [T, D] (whole on every rank):
    q = rms_norm(x) · q_rᵀ                            [T, H/N, E]: this rank's heads (column-parallel)
    a = attention(q_norm(q), xk_r, xv_r, visible)     over this rank's KV heads' image keys/values [K/N, N, E]
    x += tanh(g_attn) · all_reduce(a · o_rᵀ)          row-parallel: each rank's product is a partial sum
    x += tanh(g_mlp) · has_image · all_reduce(swiglu(rms_norm(x) · gate_up_rᵀ) · down_rᵀ)
The image (`encode_images`): every rank runs the replicated encoder and projector on the same pixels (image
tokens [N, D], whole), then each cross layer's k/v of its own KV heads, [N, D] · [K/N·E, D]ᵀ, into its cache.
A prompt without an image skips the cross layers, as HF does.

`forward` is the eager path, what a prompt runs; a decoded token runs accel.vision.model.decode_step over the
shard with accel.tp.model.RankSplit's collectives (accel.tp.vision_engine: a CUDA graph a token on the GPU), the
cross layers' gated o/down partial sums reduced as a self layer's (x + tanh(g)·Σ partials: the gate is linear).
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from refimpl.model.vision_config import MllamaConfig

from .. import ops
from ..vision import encoder
from ..vision.model import VisionStaticCache, layer_slots, request_masks
from ..vision.weights import CrossLayer
from .model import all_reduce, embed_rows, gather_logits, layer
from .vision_load import TPVisionWeights


def write_image_kv(w: TPVisionWeights, cfg: MllamaConfig, local, states, cache: VisionStaticCache) -> None:
    """The image tokens states [N, D] -> each cross layer's normed keys and values of this rank's KV heads.
    As accel.vision.model.write_image_kv: the RMSNorm with a unit weight rounds the normed keys to the model
    dtype before the k_norm weight multiplies them, as HF's k_norm does."""
    N, K, E = states.shape[0], local.num_key_value_heads, local.head_dim
    for c, (k_w, v_w, k_norm) in enumerate(w.image_kv):
        ones = torch.ones_like(k_norm)
        k = ops.rms_norm(F.linear(states, k_w).view(N * K, E), ones, cfg.text.rms_norm_eps)  # [N, D] -> [N·K, E]
        torch.mul(k.view(N, K, E).permute(1, 0, 2), k_norm, out=cache.xk_all[c])  # -> [K, N, E]
        cache.xv_all[c].copy_(F.linear(states, v_w).view(N, K, E).permute(1, 0, 2))  # [N, D] -> [K, N, E]


def encode_images(w: TPVisionWeights, cfg: MllamaConfig, local, pixel_values, aspect_ratio_ids, aspect_ratio_mask,
                  cache: VisionStaticCache) -> None:
    """pixel_values [I, A, C, X, X] and aspect_ratio_ids [I] on the device, aspect_ratio_mask [I, A] on the host
    -> the replicated encoder and projector, then this rank's image keys/values into the cache."""
    features = encoder.encode(w.vision, cfg.vision, pixel_values, aspect_ratio_ids, aspect_ratio_mask,
                              w.vision_qkv, w.vision_gates)  # [I, A, P, O]
    write_image_kv(w, cfg, local, encoder.project(w.vision, features), cache)  # [N, D]


def cross_layer(cl: CrossLayer, cfg, x, xk, xv, visible, has_image):
    """One cross-attention layer of this rank's shard (cfg: the rank's local text config) -> x [T, D];
    visible [T, N] (rows that may see no tile see every image token, as HF's mask makes them), has_image [T, 1]."""
    T, H, E, eps = x.shape[0], cfg.num_attention_heads, cfg.head_dim, cfg.rms_norm_eps
    q = ops.linear(ops.rms_norm(x, cl.attn_norm, eps), cl.q).view(T, H, E)  # [T, D] -> [T, H/N, E]
    a = ops.norm_cross_attention(q, cl.q_norm, eps, xk, xv, visible)  # [T, H/N, E]
    x = x + cl.attn_gate.tanh() * all_reduce(ops.linear(a.reshape(T, H * E), cl.o))  # [T, D], summed over ranks
    act = ops.swiglu_gate_up(ops.linear(ops.rms_norm(x, cl.mlp_norm, eps), cl.gate_up))  # [T, 2F/N] -> [T, F/N]
    down = all_reduce(ops.linear(act, cl.down)) * has_image  # full_text_row_masked_out_mask
    return x + cl.mlp_gate.tanh() * down


def forward(w: TPVisionWeights, cfg: MllamaConfig, local, first_id: int, world: int, ids: torch.Tensor, start: int,
            cache: VisionStaticCache) -> torch.Tensor:
    """ids [T] at positions start..start+T-1 -> the last token's logits [1, V], the same on every rank.
    local: the rank's text config; first_id: the first token id of its embedding rows. With an image, also the
    decode step's mask row and gates (accel.vision.model.request_masks)."""
    T = ids.shape[0]
    positions = cache.tables.slots[start:start + T]  # [T]
    cos, sin = cache.tables.cos[start:start + T], cache.tables.sin[start:start + T]  # [T, E/2]
    x = all_reduce(embed_rows(w.text.embed, ids, first_id))  # [T, D]
    if cache.has_image:
        visible, has_image = request_masks(w.cross, cfg, np.arange(start, start + T), cache, x.device)
    for i, j, c in layer_slots(cfg.text, cache.has_image):
        if j is not None:
            x = layer(w.text.layers[j], local, x, cache.k_all[j], cache.v_all[j], cos, sin, positions)
        else:
            x = cross_layer(w.cross[c], local, x, cache.xk_all[c], cache.xv_all[c], visible, has_image)
    h = ops.rms_norm(x[-1:], w.text.norm, local.rms_norm_eps)  # [1, D]
    return gather_logits(ops.linear(h, w.text.lm_head), world, cfg.vocab_size)  # [1, ceil(V/N)] -> [1, V]
