"""The fast vision encoder + projector: refimpl.vision.encoder's computation (trace mode runs that one over
accel.ops), rearranged for speed:
    * every tile of every image in one pass: the row-wise ops and GEMMs see all I·A·Q tokens at once, and the
      self-attention runs as one batched SDPA call over [I, H, L, E] with HF's padding mask (pad×pad pairs blocked);
    * the patch embedding is one GEMM over unfolded patches (the stride-14 conv);
    * biases go into the GEMM (F.linear's fused epilogue), LayerNorm and GELU are torch's fused kernels;
    * nothing yields or keeps values beyond the intermediate layers the output needs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from refimpl.model.mllama_config import VisionConfig
from refimpl.vision.encoder import (PRE_POST_NORM_EPS, aspect_ratio_embedding, padding_mask, position_embedding,
                                    unfold_patches)


def _layer(p: dict, prefix: str, x, mask, cfg: VisionConfig, I: int, gated: bool):
    """One pre-norm layer over x [I·L, U]; mask [I, 1, L, L] bool (True = may attend)."""
    L, H, E, eps = x.shape[0] // I, cfg.attention_heads, cfg.head_dim, cfg.norm_eps
    U = x.shape[1]

    def w(name):
        return p[prefix + name]

    h = F.layer_norm(x, (U,), w("input_layernorm.weight"), w("input_layernorm.bias"), eps)
    q, k, v = (F.linear(h, w(f"self_attn.{n}_proj.weight")).view(I, L, H, E).transpose(1, 2)
               for n in "qkv")  # [I·L, U] -> [I, H, L, E]
    a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [I, H, L, E]
    o = F.linear(a.transpose(1, 2).reshape(I * L, H * E), w("self_attn.o_proj.weight"))  # -> [I·L, U]
    x = x + (w("gate_attn").tanh() * o if gated else o)
    h = F.layer_norm(x, (U,), w("post_attention_layernorm.weight"), w("post_attention_layernorm.bias"), eps)
    up = F.gelu(F.linear(h, w("mlp.fc1.weight"), w("mlp.fc1.bias")))  # [I·L, U] -> [I·L, M]
    down = F.linear(up, w("mlp.fc2.weight"), w("mlp.fc2.bias"))  # [I·L, M] -> [I·L, U]
    return x + (w("gate_ffn").tanh() * down if gated else down)


def encode(p: dict, cfg: VisionConfig, pixel_values, aspect_ratio_ids, aspect_ratio_mask):
    """pixel_values [I, A, C, X, X] and aspect_ratio_ids [I] (device tensors), aspect_ratio_mask [I, A] (host)
    -> image features [I, A, P, O]."""
    I, A = pixel_values.shape[:2]
    P, Q, U = cfg.tokens_per_tile, cfg.padded_tokens_per_tile, cfg.hidden_size
    L = A * Q
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
    mask = torch.as_tensor(padding_mask(aspect_ratio_mask, P, Q), device=x.device)[:, None]  # [I, 1, L, L]

    keep = set(cfg.intermediate_layers_indices)
    kept = {}
    for i in range(cfg.num_hidden_layers):
        x = _layer(p, f"{pre}transformer.layers.{i}.", x, mask, cfg, I, gated=False)
        if i in keep:
            kept[i] = x
    x = F.layer_norm(x, (U,), p[pre + "layernorm_post.weight"], p[pre + "layernorm_post.bias"], PRE_POST_NORM_EPS)
    x = (x.view(I, A, Q, U) + aspect_ratio_embedding(p, pre + "post_tile_positional_embedding.", aspect_ratio_ids,
                                                      A)).view(I * L, U)
    for i in range(cfg.num_global_layers):
        x = _layer(p, f"{pre}global_transformer.layers.{i}.", x, mask, cfg, I, gated=True)
    # final features, then the intermediate ones interleaved (feature d·J + l), as refimpl.vision.encoder explains
    inter = torch.stack([kept[i] for i in cfg.intermediate_layers_indices], dim=-1)  # [I·L, U, J]
    out = torch.cat([x.view(I, A, Q, U), inter.view(I, A, Q, -1)], dim=-1)  # [I, A, Q, O]
    return out[:, :, :P]  # drop the padding -> [I, A, P, O]


def project(p: dict, features):
    """[I, A, P, O] -> the image tokens [N, D]."""
    rows = features.reshape(-1, features.shape[-1])  # [I, A, P, O] -> [N, O]
    return F.linear(rows, p["multi_modal_projector.weight"], p["multi_modal_projector.bias"])  # -> [N, D]
