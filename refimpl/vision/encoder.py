"""The Llama 3.2 Vision image encoder and projector, as HF's MllamaVisionModel + multi_modal_projector compute them.

Every image is cut into A tiles of X×X pixels (padding tiles are zeros); each tile becomes P = (X/Z)² + 1 tokens
(patches plus a class token), padded to Q (a multiple of 8). The "local" transformer and the gated "global"
transformer both attend over all A·Q tokens of one image. The output stacks the final features with those of the
intermediate layers, and the projector maps them into the text model's hidden size: the image keys/values of every
cross-attention layer come from there.

Images are processed together: row-wise ops see all I·L rows at once, attention runs per image.
Parameters keep the checkpoint's names (`vision_model.transformer.layers.0.mlp.fc1.weight`).
"""
from __future__ import annotations

import numpy as np

from refimpl.model import arrays
from refimpl.model.llama import Steps, emit
from refimpl.model.vision_config import VisionConfig

PRE_POST_NORM_EPS = 1e-5  # layernorm_pre/_post are built without the config's norm_eps, so torch's default


def unfold_patches(pixels, patch: int):
    """pixels [I, A, C, X, X] -> [I, A, (X/Z)², C·Z·Z], patches in row-major order, each flattened (c, y, x)
    like the conv weight, so the stride-Z convolution becomes one matmul."""
    I, A, C, X, _ = pixels.shape
    n = X // patch
    p = pixels.reshape(I, A, C, n, patch, n, patch)  # [I, A, C, X, X] -> [I, A, C, n, Z, n, Z]
    p = arrays.permute(p, (0, 1, 3, 5, 2, 4, 6))  # -> [I, A, n, n, C, Z, Z]
    return p.reshape(I, A, n * n, C * patch * patch)  # -> [I, A, n², C·Z·Z]


def aspect_ratio_embedding(p: dict, prefix: str, aspect_ratio_ids, A: int):
    """The gated per-tile vector of each image's aspect ratio: [I, A, 1, U] (broadcasts over a tile's tokens)."""
    table = p[prefix + "embedding.weight"]  # [R+1, A·U]
    gate = arrays.tanh(p[prefix + "gate"])  # [1]
    return (table[aspect_ratio_ids] * gate).reshape(len(aspect_ratio_ids), A, 1, -1)  # [I, A·U] -> [I, A, 1, U]


def position_embedding(p: dict, aspect_ratio_ids, A: int, P: int):
    """Gated mix of the shared per-token embedding and the per-(aspect ratio, tile, token) one: [I, A, P, U]."""
    pre = "vision_model.gated_positional_embedding."
    gate = arrays.tanh(p[pre + "gate"])  # [1]
    shared = (1 - gate) * p[pre + "embedding"]  # [P, U]
    tiles = p[pre + "tile_embedding.weight"][aspect_ratio_ids]  # [R+1, A·P·U][I] -> [I, A·P·U]
    return shared + gate * tiles.reshape(len(aspect_ratio_ids), A, P, -1)  # [P, U] + [I, A, P, U]


def padding_tokens(aspect_ratio_mask, P: int, Q: int):
    """[I, L] bool, True = a "masked" token: padding (index ≥ P in its tile) or in a padding tile."""
    I, A = aspect_ratio_mask.shape
    pad_token = np.arange(Q) >= P  # [Q]
    masked = (aspect_ratio_mask[:, :, None] == 0) | pad_token[None, None, :]  # [I, A, 1] | [1, 1, Q] -> [I, A, Q]
    return masked.reshape(I, A * Q)  # -> [I, L]


def padding_mask(aspect_ratio_mask, P: int, Q: int):
    """[I, L, L] bool, True = may attend, as HF's `_prepare_aspect_ratio_attention_mask` builds it.

    Only pairs of two masked tokens (`padding_tokens`) are blocked. Real tokens therefore still attend to padding
    (Meta's reference does the same): reproduced, not fixed, because the features depend on it.
    """
    masked = padding_tokens(aspect_ratio_mask, P, Q)  # [I, L]
    return ~(masked[:, :, None] & masked[:, None, :])  # [I, L, 1] & [I, 1, L] -> [I, L, L]


def encoder_layer(ops, p: dict, x, visible, cfg: VisionConfig, name: str, gated: bool, I: int) -> Steps:
    """One pre-norm transformer layer over rows x [I·L, U]; `gated` layers (global) scale each branch by tanh."""
    L, H, E = x.shape[0] // I, cfg.attention_heads, cfg.head_dim
    eps = cfg.norm_eps
    h = yield from emit(name + "attn_norm", ops.layer_norm(x, p["input_layernorm.weight"],
                                                           p["input_layernorm.bias"], eps))
    q = ops.linear(h, p["self_attn.q_proj.weight"]).reshape(I, L, H, E)  # [I·L, U] -> [I, L, H, E]
    q = yield from emit(name + "attn.q", q)
    k = ops.linear(h, p["self_attn.k_proj.weight"]).reshape(I, L, H, E)  # [I·L, U] -> [I, L, H, E]
    k = yield from emit(name + "attn.k", k)
    v = ops.linear(h, p["self_attn.v_proj.weight"]).reshape(I, L, H, E)  # [I·L, U] -> [I, L, H, E]
    v = yield from emit(name + "attn.v", v)
    a = arrays.zeros(q, (I, L, H, E))
    for i in range(I):  # attention stays within an image
        a[i] = ops.encoder_attention(q[i], k[i], v[i], visible[i])  # [L, H, E]
    a = yield from emit(name + "attn.out", a)
    o = ops.linear(a.reshape(I * L, H * E), p["self_attn.o_proj.weight"])  # [I·L, H·E] -> [I·L, U]
    o = yield from emit(name + "attn.o_proj", o)
    if gated:
        o = arrays.tanh(p["gate_attn"]) * o
    x = yield from emit(name + "resid_mid", x + o)
    h = yield from emit(name + "mlp_norm", ops.layer_norm(x, p["post_attention_layernorm.weight"],
                                                          p["post_attention_layernorm.bias"], eps))
    up = ops.linear(h, p["mlp.fc1.weight"]) + p["mlp.fc1.bias"]  # [I·L, U] -> [I·L, M]
    up = yield from emit(name + "mlp.fc1", up)
    act = yield from emit(name + "mlp.act", ops.gelu(up))  # [I·L, M]
    down = ops.linear(act, p["mlp.fc2.weight"]) + p["mlp.fc2.bias"]  # [I·L, M] -> [I·L, U]
    down = yield from emit(name + "mlp.fc2", down)
    if gated:
        down = arrays.tanh(p["gate_ffn"]) * down
    return (yield from emit(name + "resid_post", x + down))


def layer_params(params: dict, stack: str, i: int) -> dict:
    """Layer i of `transformer` or `global_transformer`, keyed by its names inside the layer."""
    prefix = f"vision_model.{stack}.layers.{i}."
    return {name[len(prefix):]: value for name, value in params.items() if name.startswith(prefix)}


def vision_steps(ops, params: dict, cfg: VisionConfig, pixel_values, aspect_ratio_ids, aspect_ratio_mask) -> Steps:
    """pixel_values [I, A, C, X, X], aspect_ratio_ids [I], aspect_ratio_mask [I, A] -> image features [I, A, P, O]."""
    I, A = pixel_values.shape[:2]
    P, Q, U = cfg.tokens_per_tile, cfg.padded_tokens_per_tile, cfg.hidden_size
    L = A * Q
    pre = "vision_model."
    weight = params[pre + "patch_embedding.weight"].reshape(U, -1)  # [U, C, Z, Z] -> [U, C·Z·Z]
    patches = unfold_patches(pixel_values, cfg.patch_size).reshape(I * A * (P - 1), -1)  # -> [I·A·(P-1), C·Z·Z]
    x = ops.linear(patches, weight).reshape(I, A, P - 1, U)  # [I·A·(P-1), C·Z·Z] -> [I, A, P-1, U]
    x = yield from emit("vision.patch_embed", x)
    pre_tile = aspect_ratio_embedding(params, pre + "pre_tile_positional_embedding.", aspect_ratio_ids, A)
    x = x + pre_tile  # [I, A, P-1, U] + [I, A, 1, U]
    x = yield from emit("vision.pre_tile", x)
    tokens = arrays.zeros(x, (I, A, P, U))
    tokens[:, :, 0] = params[pre + "class_embedding"]  # the class token first: [U] -> [I, A, 1, U]
    tokens[:, :, 1:] = x
    x = tokens  # [I, A, P, U]
    x = yield from emit("vision.pos_embed", x + position_embedding(params, aspect_ratio_ids, A, P))
    x = ops.layer_norm(x, params[pre + "layernorm_pre.weight"], params[pre + "layernorm_pre.bias"],
                       PRE_POST_NORM_EPS)
    x = yield from emit("vision.layernorm_pre", x)  # [I, A, P, U]
    padded = arrays.zeros(x, (I, A, Q, U))
    padded[:, :, :P] = x  # zero padding: [I, A, P, U] -> [I, A, Q, U]
    x = padded.reshape(I * L, U)  # -> [I·L, U]
    visible = padding_mask(np.asarray(aspect_ratio_mask), P, Q)  # [I, L, L]

    kept = []
    for i in range(cfg.num_hidden_layers):
        x = yield from encoder_layer(ops, layer_params(params, "transformer", i), x, visible, cfg,
                                     f"vision.layers.{i}.", gated=False, I=I)
        kept.append(x)  # each layer's *output*, as transformers 5 keeps them (Meta's reference and 4.x: its input)
    x = ops.layer_norm(x, params[pre + "layernorm_post.weight"], params[pre + "layernorm_post.bias"],
                       PRE_POST_NORM_EPS)
    x = yield from emit("vision.layernorm_post", x)  # [I·L, U]
    x = x.reshape(I, A, Q, U)  # [I·L, U] -> [I, A, Q, U]
    post_tile = aspect_ratio_embedding(params, pre + "post_tile_positional_embedding.", aspect_ratio_ids, A)
    x = x + post_tile  # [I, A, Q, U] + [I, A, 1, U]: padding tokens get it too, as in HF
    x = yield from emit("vision.post_tile", x.reshape(I * L, U))  # -> [I·L, U]
    for i in range(cfg.num_global_layers):
        x = yield from encoder_layer(ops, layer_params(params, "global_transformer", i), x, visible, cfg,
                                     f"vision.global.{i}.", gated=True, I=I)

    final = x.reshape(I, A, Q, U)[:, :, :P]  # drop the padding: [I·L, U] -> [I, A, P, U]
    # Stacked on a new last axis, then flattened: feature d·J + l is feature d of intermediate layer l
    # (interleaved, not concatenated layer after layer).
    layers = cfg.intermediate_layers_indices
    inter = arrays.zeros(x, (I * L, U, len(layers)))
    for j, i in enumerate(layers):
        inter[:, :, j] = kept[i]  # J × [I·L, U] -> [I·L, U, J]
    inter = inter.reshape(I, A, Q, -1)[:, :, :P]  # -> [I, A, P, U·J]
    out = arrays.zeros(x, (I, A, P, U * (1 + len(layers))))
    out[..., :U], out[..., U:] = final, inter  # -> [I, A, P, O]
    return (yield from emit("vision.out", out))


def project(ops, params: dict, features) -> Steps:
    """Image features [I, A, P, O] -> the text model's image tokens [N, D], N = I·A·P in image, tile, token order."""
    rows = features.reshape(-1, features.shape[-1])  # [I, A, P, O] -> [N, O]
    out = ops.linear(rows, params["multi_modal_projector.weight"]) + params["multi_modal_projector.bias"]  # -> [N, D]
    return (yield from emit("projector", out))
