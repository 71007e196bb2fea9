"""The fast vision encoder + projector: refimpl.vision.encoder's computation (trace mode runs that one over
accel.ops), rearranged for speed:
    * every tile of every image in one pass: the row-wise ops and GEMMs see all I·A·Q tokens at once;
    * the patch embedding is one GEMM over unfolded patches (the stride-14 conv), and each layer's q/k/v one GEMM
      over the fused [3·U, U] weight (accel.vision.weights); attention reads q/k/v as strided views of its output;
    * the self-attention is one unmasked SDPA call over all images (a fused kernel: cuDNN's on the H200), then
      each image's padding rows again, over its real keys only (`PaddingRows`: HF's pad×pad mask);
    * biases go into the GEMMs (F.linear's epilogue), the attention branch's residual (and its tanh gate, a number
      read at load) into the o_proj GEMM (addmm, in place); the MLP branch's residual add and the next layer's input
      LayerNorm are one Triton pass (accel.kernels.layer_norm), as is the post-attention LayerNorm; GELU is torch's;
    * no host sync once the first kernel is queued;
    * nothing yields or keeps values beyond the intermediate layers the output needs.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from refimpl.model.vision_config import VisionConfig
from refimpl.vision.encoder import (PRE_POST_NORM_EPS, aspect_ratio_embedding, padding_tokens, position_embedding,
                                    unfold_patches)

from ..kernels.decode_attn import cross_decode_attention_fwd
from ..kernels.layer_norm import add_layer_norm_fwd, layer_norm_fwd
from ..ops import uses_triton


FEW_ROWS = 64  # an image's padding rows up to this many take the split-K decode-attention kernel


class PaddingRows:
    """HF's encoder mask (only pairs of two padding tokens blocked) as the rows it changes: every real query row
    sees every key, so attention runs unmasked for all rows; a padding row sees exactly its image's real keys, so
    each image's padding rows are then recomputed, unmasked, over those keys alone. Built once per encode from the
    host's aspect_ratio_mask in one host-to-device copy (`encode` builds it before launching anything, so the copy
    waits on no work): per image with padding (index, padding rows [R], real-key flags over its tokens [L]
    (the decode kernel's mask), real keys [N] (SDPA's gather)), int64 device tensors."""

    def __init__(self, aspect_ratio_mask, P: int, Q: int, device):
        masked = padding_tokens(aspect_ratio_mask, P, Q)  # [I, L]
        padded = [i for i, m in enumerate(masked) if m.any()]
        parts = [a for i in padded for a in (np.flatnonzero(masked[i]), ~masked[i], np.flatnonzero(~masked[i]))]
        views = torch.as_tensor(np.concatenate(parts).astype(np.int64)).to(device).split(
            [len(a) for a in parts]) if parts else ()
        self.images = [(i, *views[3 * n:3 * n + 3]) for n, i in enumerate(padded)]


def self_attention(qkv, pad: PaddingRows, I: int, H: int, E: int):
    """qkv [I·L, 3·H·E] (q, k, v side by side, one fused GEMM's output) -> [I·L, H·E], HF's padding mask.
    SDPA reads q/k/v as strided views; unmasked it takes a fused kernel, which beat the Triton kernels at the
    encoder's shape (docs/performance.md). A few padding rows (a full image has 28) go through the split-K
    decode kernel, their R rows as the query heads of one token (head h's rows share kv head h), reading the
    image's keys/values in place under the real-key mask: a fused prefill kernel would give them one program per
    head, each walking all keys alone, and gathering the real keys copied 2 × [H, N, E] a layer."""
    L = qkv.shape[0] // I
    q, k, v = (x.transpose(1, 2) for x in qkv.view(I, L, 3, H, E).unbind(2))  # each [I, H, L, E], views
    a = F.scaled_dot_product_attention(q, k, v)  # [I, H, L, E]: right for every real query row
    for i, rows, real, keys in pad.images:
        R = len(rows)
        qi = q[i][:, rows]  # [H, R, E] (a copy)
        if uses_triton(qkv) and R <= FEW_ROWS:
            out = cross_decode_attention_fwd(qi.reshape(1, H * R, E), k[i], v[i], real, None, 0.0)  # [1, H·R, E]
        else:
            ki, vi = k[i][:, keys], v[i][:, keys]  # [H, N, E] each (copies)
            out = F.scaled_dot_product_attention(qi[None], ki[None], vi[None])  # 4-D: a fused kernel, not math
        a[i][:, rows] = out.reshape(H, R, E)
    return a.transpose(1, 2).reshape(I * L, H * E)


def _norm(x, weight, bias, eps):
    if uses_triton(x):
        return layer_norm_fwd(x, weight, bias, eps)
    return F.layer_norm(x, (x.shape[1],), weight, bias, eps)


def _add_norm(x, r, alpha: float, norm: tuple | None):
    """(x + alpha·r, its LayerNorm by norm = (weight, bias, eps), or None without one): one pass on Triton devices."""
    if norm is None:
        return torch.add(x, r, alpha=alpha), None
    if uses_triton(x):
        return add_layer_norm_fwd(x, r, alpha, *norm)
    x = torch.add(x, r, alpha=alpha)
    return x, _norm(x, *norm)


def _layer(p: dict, prefix: str, x, h, qkv_weight, pad, cfg: VisionConfig, I: int, gates: tuple[float, float],
           next_norm: tuple | None, x_is_kept: bool):
    """One pre-norm layer over x [I·L, U], given h = its input LayerNorm of x -> (output, next_norm(output) or None).
    gates = (tanh(gate_attn), tanh(gate_ffn)), 1.0 for ungated layers. The attention residual goes into x in place
    (out of place addmm first copies x) unless x is a kept intermediate output."""
    H, E, eps = cfg.attention_heads, cfg.head_dim, cfg.norm_eps

    def w(name):
        return p[prefix + name]

    a = self_attention(F.linear(h, qkv_weight), pad, I, H, E)  # [I·L, U] -> [I·L, 3·U] -> [I·L, U]
    residual = torch.addmm if x_is_kept else torch.Tensor.addmm_
    x = residual(x, a, w("self_attn.o_proj.weight").t(), alpha=gates[0])  # x + g·(a W_oᵀ): [I·L, U]
    h = _norm(x, w("post_attention_layernorm.weight"), w("post_attention_layernorm.bias"), eps)
    up = F.gelu(F.linear(h, w("mlp.fc1.weight"), w("mlp.fc1.bias")))  # [I·L, U] -> [I·L, M]
    down = F.linear(up, w("mlp.fc2.weight"), w("mlp.fc2.bias"))  # [I·L, M] -> [I·L, U]
    return _add_norm(x, down, gates[1], next_norm)


def _stack(p: dict, cfg: VisionConfig, stack: str, n: int, x, qkv, pad, I: int, gates, kept: dict | None):
    """The n layers of `stack` over x [I·L, U]; each layer's residual add is fused with the next one's input norm.
    `kept` collects the outputs of the intermediate layers."""
    def input_norm(i):
        pre = f"vision_model.{stack}.layers.{i}.input_layernorm."
        return p[pre + "weight"], p[pre + "bias"], cfg.norm_eps

    h = _norm(x, *input_norm(0)) if n else None
    keeps = cfg.intermediate_layers_indices if kept is not None else ()
    for i in range(n):
        prefix = f"vision_model.{stack}.layers.{i}."
        x, h = _layer(p, prefix, x, h, qkv[prefix], pad, cfg, I, gates[i],
                      input_norm(i + 1) if i + 1 < n else None, i - 1 in keeps)
        if i in keeps:
            kept[i] = x
    return x


def encode(p: dict, cfg: VisionConfig, pixel_values, aspect_ratio_ids, aspect_ratio_mask,
           qkv: dict[str, torch.Tensor], gates: list[tuple[float, float]]):
    """pixel_values [I, A, C, X, X] and aspect_ratio_ids [I] (device tensors), aspect_ratio_mask [I, A] (host),
    qkv: the fused q/k/v weights by layer prefix (VisionWeights.vision_qkv), gates: tanh of each global layer's
    two gates as numbers (VisionWeights.vision_gates: read once at load, no host sync here) -> image features
    [I, A, P, O]."""
    I, A = pixel_values.shape[:2]
    P, Q, U = cfg.tokens_per_tile, cfg.padded_tokens_per_tile, cfg.hidden_size
    L = A * Q
    pad = PaddingRows(aspect_ratio_mask, P, Q, pixel_values.device)  # its copy first: nothing queued to wait on
    pre = "vision_model."
    weight = p[pre + "patch_embedding.weight"].reshape(U, -1)  # [U, C, Z, Z] -> [U, C·Z·Z]
    patches = unfold_patches(pixel_values, cfg.patch_size).reshape(I * A * (P - 1), -1)  # [I·A·(P-1), C·Z·Z]
    x = F.linear(patches, weight).view(I, A, P - 1, U)  # one GEMM: [I·A·(P-1), C·Z·Z] -> [I, A, P-1, U]
    x = x + aspect_ratio_embedding(p, pre + "pre_tile_positional_embedding.", aspect_ratio_ids, A)
    tokens = x.new_zeros(I, A, Q, U)  # the class token first, zero padding after the P real tokens
    tokens[:, :, 0] = p[pre + "class_embedding"]
    tokens[:, :, 1:P] = x
    tokens[:, :, :P] += position_embedding(p, aspect_ratio_ids, A, P)
    tokens[:, :, :P] = F.layer_norm(tokens[:, :, :P], (U,), p[pre + "layernorm_pre.weight"],
                                    p[pre + "layernorm_pre.bias"], PRE_POST_NORM_EPS)
    x = tokens.view(I * L, U)

    kept = {}
    x = _stack(p, cfg, "transformer", cfg.num_hidden_layers, x, qkv, pad, I, [(1.0, 1.0)] * cfg.num_hidden_layers,
               kept)
    x = _norm(x, p[pre + "layernorm_post.weight"], p[pre + "layernorm_post.bias"], PRE_POST_NORM_EPS)
    x = (x.view(I, A, Q, U) + aspect_ratio_embedding(p, pre + "post_tile_positional_embedding.", aspect_ratio_ids,
                                                      A)).view(I * L, U)
    x = _stack(p, cfg, "global_transformer", cfg.num_global_layers, x, qkv, pad, I, gates, None)
    # final features, then the intermediate ones interleaved (feature d·J + l), as refimpl.vision.encoder explains
    J = len(cfg.intermediate_layers_indices)
    out = x.new_empty(I * L, U * (1 + J))  # [I·L, O]
    out[:, :U] = x
    inter = torch.stack([kept[i] for i in cfg.intermediate_layers_indices])  # [J, I·L, U], contiguous blocks
    out[:, U:].view(I * L, U, J).copy_(inter.permute(1, 2, 0))  # -> [I·L, U, J]: one transposing copy
    return out.view(I, A, Q, -1)[:, :, :P]  # drop the padding -> [I, A, P, O]


def project(p: dict, features):
    """[I, A, P, O] -> the image tokens [N, D]."""
    rows = features.reshape(-1, features.shape[-1])  # [I, A, P, O] -> [N, O]
    return F.linear(rows, p["multi_modal_projector.weight"], p["multi_modal_projector.bias"])  # -> [N, D]
