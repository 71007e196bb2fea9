"""The fast vision encoder + projector: refimpl.vision.encoder's computation (trace mode runs that one over
accel.ops), rearranged for speed:
    * every tile of every image in one pass: the row-wise ops and GEMMs see all I·A·Q tokens at once;
    * the patch embedding is one GEMM over unfolded patches (the stride-14 conv), and each layer's q/k/v one GEMM
      over the fused [3·U, U] weight (accel.vision.weights); attention reads q/k/v as strided views of its output;
    * the self-attention is accel.kernels.encoder_attn (non-causal flash attention, HF's pad×pad mask from a
      per-token padding flag, head dim 80 as 64 + 16) on Triton devices, one batched SDPA call otherwise;
    * biases go into the GEMMs (F.linear's epilogue), the attention branch's residual (and its tanh gate, a scalar
      read once) into the o_proj GEMM (addmm); LayerNorm and GELU are torch's fused kernels;
    * nothing yields or keeps values beyond the intermediate layers the output needs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from refimpl.model.mllama_config import VisionConfig
from refimpl.vision.encoder import (PRE_POST_NORM_EPS, aspect_ratio_embedding, padding_tokens, position_embedding,
                                    unfold_patches)

from ..kernels.encoder_attn import encoder_attention
from ..ops import uses_triton


def _attention(qkv, pad, I: int, H: int, E: int):
    """qkv [I·L, 3·H·E] (q, k, v side by side), pad [I, L] bool (True = padding) -> [I·L, H·E]."""
    L = qkv.shape[0] // I
    q, k, v = qkv.view(I, L, 3, H, E).unbind(2)  # each [I, L, H, E], strided views
    if uses_triton(qkv):
        return encoder_attention(q, k, v, pad).view(I * L, H * E)
    visible = ~(pad[:, :, None] & pad[:, None, :])  # [I, L, L]: only pad×pad pairs blocked
    a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       attn_mask=visible[:, None])  # [I, H, L, E]
    return a.transpose(1, 2).reshape(I * L, H * E)


def _layer(p: dict, prefix: str, x, qkv_weight, pad, cfg: VisionConfig, I: int, gates: tuple[float, float]):
    """One pre-norm layer over x [I·L, U]; gates = (tanh(gate_attn), tanh(gate_ffn)), 1.0 for ungated layers."""
    U, H, E, eps = x.shape[1], cfg.attention_heads, cfg.head_dim, cfg.norm_eps

    def w(name):
        return p[prefix + name]

    h = F.layer_norm(x, (U,), w("input_layernorm.weight"), w("input_layernorm.bias"), eps)
    a = _attention(F.linear(h, qkv_weight), pad, I, H, E)  # [I·L, U] -> [I·L, 3·U] -> [I·L, U]
    x = torch.addmm(x, a, w("self_attn.o_proj.weight").t(), alpha=gates[0])  # x + g·(a W_oᵀ): [I·L, U]
    h = F.layer_norm(x, (U,), w("post_attention_layernorm.weight"), w("post_attention_layernorm.bias"), eps)
    up = F.gelu(F.linear(h, w("mlp.fc1.weight"), w("mlp.fc1.bias")))  # [I·L, U] -> [I·L, M]
    down = F.linear(up, w("mlp.fc2.weight"), w("mlp.fc2.bias"))  # [I·L, M] -> [I·L, U]
    return torch.add(x, down, alpha=gates[1])


def _gates(p: dict, cfg: VisionConfig) -> list[tuple[float, float]]:
    """tanh of every global layer's two gates, read to the host once (addmm takes its scale as a number)."""
    names = [f"vision_model.global_transformer.layers.{i}.gate_{g}" for i in range(cfg.num_global_layers)
             for g in ("attn", "ffn")]
    if not names:
        return []
    g = torch.cat([p[n].reshape(1).float() for n in names]).tanh().tolist()
    return list(zip(g[0::2], g[1::2]))


def _qkv(p: dict, prefix: str, fused: dict | None):
    """The layer's fused [3·U, U] q/k/v weight: the one built at load, else concatenated here."""
    if fused and prefix in fused:
        return fused[prefix]
    return torch.cat([p[f"{prefix}self_attn.{n}_proj.weight"] for n in "qkv"])


def encode(p: dict, cfg: VisionConfig, pixel_values, aspect_ratio_ids, aspect_ratio_mask,
           qkv: dict[str, torch.Tensor] | None = None):
    """pixel_values [I, A, C, X, X] and aspect_ratio_ids [I] (device tensors), aspect_ratio_mask [I, A] (host),
    qkv: the fused q/k/v weights by layer prefix (MllamaWeights.vision_qkv) -> image features [I, A, P, O]."""
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
    pad = torch.as_tensor(padding_tokens(aspect_ratio_mask, P, Q), device=x.device)  # [I, L]
    gates = _gates(p, cfg)

    keep = set(cfg.intermediate_layers_indices)
    kept = {}
    for i in range(cfg.num_hidden_layers):
        prefix = f"{pre}transformer.layers.{i}."
        x = _layer(p, prefix, x, _qkv(p, prefix, qkv), pad, cfg, I, (1.0, 1.0))
        if i in keep:
            kept[i] = x
    x = F.layer_norm(x, (U,), p[pre + "layernorm_post.weight"], p[pre + "layernorm_post.bias"], PRE_POST_NORM_EPS)
    x = (x.view(I, A, Q, U) + aspect_ratio_embedding(p, pre + "post_tile_positional_embedding.", aspect_ratio_ids,
                                                      A)).view(I * L, U)
    for i in range(cfg.num_global_layers):
        prefix = f"{pre}global_transformer.layers.{i}."
        x = _layer(p, prefix, x, _qkv(p, prefix, qkv), pad, cfg, I, gates[i])
    # final features, then the intermediate ones interleaved (feature d·J + l), as refimpl.vision.encoder explains
    inter = torch.stack([kept[i] for i in cfg.intermediate_layers_indices], dim=-1)  # [I·L, U, J]
    out = torch.cat([x.view(I, A, Q, U), inter.view(I, A, Q, -1)], dim=-1)  # [I, A, Q, O]
    return out[:, :, :P]  # drop the padding -> [I, A, P, O]


def project(p: dict, features):
    """[I, A, P, O] -> the image tokens [N, D]."""
    rows = features.reshape(-1, features.shape[-1])  # [I, A, P, O] -> [N, O]
    return F.linear(rows, p["multi_modal_projector.weight"], p["multi_modal_projector.bias"])  # -> [N, D]
