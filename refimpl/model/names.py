"""The one activation-name scheme: used by both backends, the golden files, the CLI filters and the reports.

Order is the order of computation in a forward; `tests/test_names.py` pins it exactly.

    embed                         [T, D]     token embeddings
    layers.{i}.attn_norm          [T, D]     RMSNorm before attention
    layers.{i}.attn.q             [T, H, E]  q_proj output, split into heads
    layers.{i}.attn.k             [T, K, E]
    layers.{i}.attn.v             [T, K, E]
    layers.{i}.attn.q_rot         [T, H, E]  after RoPE
    layers.{i}.attn.k_rot         [T, K, E]
    layers.{i}.attn.out           [T, H, E]  softmax(q kᵀ) v, before o_proj
    layers.{i}.attn.o_proj        [T, D]
    layers.{i}.resid_mid          [T, D]     residual after attention
    layers.{i}.mlp_norm           [T, D]
    layers.{i}.mlp.gate           [T, F]
    layers.{i}.mlp.up             [T, F]
    layers.{i}.mlp.act            [T, F]     silu(gate) · up
    layers.{i}.mlp.down           [T, D]
    layers.{i}.resid_post         [T, D]     residual after the MLP: the layer's output
    final_norm                    [T, D]
    logits                        [T, V]     (only the last row during generation prefill)

Llama 3.2 Vision (refimpl.model.llama_vision) adds, on the call that encodes the prompt's images, before `embed`:

    vision.patch_embed            [I, A, P-1, U]  the stride-Z patch convolution, as a matmul
    vision.pre_tile               [I, A, P-1, U]  + gated aspect-ratio embedding (one vector per tile)
    vision.pos_embed              [I, A, P, U]    class token prepended, + gated position / tile-position embedding
    vision.layernorm_pre          [I, A, P, U]    (then zero-padded to Q tokens a tile: L = A·Q a sequence)
    vision.layers.{i}.*           the local encoder layers, rows [I·L, ...]: attn_norm, attn.q/k/v [I, L, H, E],
                                  attn.out [I, L, H, E], attn.o_proj, resid_mid, mlp_norm, mlp.fc1 [I·L, M],
                                  mlp.act (gelu), mlp.fc2, resid_post [I·L, U]
    vision.layernorm_post         [I·L, U]
    vision.post_tile              [I·L, U]        + gated aspect-ratio embedding
    vision.global.{i}.*           the gated global encoder layers, same names (branches scaled by tanh(gate))
    vision.out                    [I, A, P, O]    final features then the intermediate ones, interleaved
    projector                     [N, D]          the image tokens every cross-attention layer reads (N = I·A·P)

and its decoder's cross-attention layers (at cross_attention_layers, when an image is in the prompt) yield

    layers.{i}.xattn_norm         [T, D]
    layers.{i}.xattn.q            [T, H, E]
    layers.{i}.xattn.q_norm       [T, H, E]  RMSNorm over E
    layers.{i}.xattn.k            [N, K, E]  \
    layers.{i}.xattn.k_norm       [N, K, E]   } only on the call that encodes the images (then cached)
    layers.{i}.xattn.v            [N, K, E]  /
    layers.{i}.xattn.out          [T, H, E]
    layers.{i}.xattn.o_proj       [T, D]
    layers.{i}.resid_mid          [T, D]     x + tanh(attn gate) · o_proj
    layers.{i}.mlp_norm ... mlp.down         as in a self-attention layer
    layers.{i}.resid_post         [T, D]     x + tanh(mlp gate) · (row has an image) · mlp.down

CLI filters are shell-style globs over these names (`layers.7.attn.*`, `*.mlp.act`).
"""
from __future__ import annotations

import fnmatch
import re

LAYER_ACTIVATIONS: tuple[str, ...] = (
    "attn_norm", "attn.q", "attn.k", "attn.v", "attn.q_rot", "attn.k_rot", "attn.out", "attn.o_proj",
    "resid_mid", "mlp_norm", "mlp.gate", "mlp.up", "mlp.act", "mlp.down", "resid_post",
)


def activation_names(num_layers: int) -> list[str]:
    names = ["embed"]
    for i in range(num_layers):
        names += [f"layers.{i}.{a}" for a in LAYER_ACTIVATIONS]
    return names + ["final_norm", "logits"]


VISION_LAYER_ACTIVATIONS: tuple[str, ...] = (
    "attn_norm", "attn.q", "attn.k", "attn.v", "attn.out", "attn.o_proj", "resid_mid", "mlp_norm", "mlp.fc1",
    "mlp.act", "mlp.fc2", "resid_post",
)
CROSS_LAYER_ACTIVATIONS: tuple[str, ...] = (
    "xattn_norm", "xattn.q", "xattn.q_norm", "xattn.k", "xattn.k_norm", "xattn.v", "xattn.out", "xattn.o_proj",
    "resid_mid", "mlp_norm", "mlp.gate", "mlp.up", "mlp.act", "mlp.down", "resid_post",
)
IMAGE_KV_ACTIVATIONS = ("xattn.k", "xattn.k_norm", "xattn.v")


def encoder_activation_names(num_layers: int, num_global_layers: int) -> list[str]:
    names = ["vision.patch_embed", "vision.pre_tile", "vision.pos_embed", "vision.layernorm_pre"]
    for i in range(num_layers):
        names += [f"vision.layers.{i}.{a}" for a in VISION_LAYER_ACTIVATIONS]
    names += ["vision.layernorm_post", "vision.post_tile"]
    for i in range(num_global_layers):
        names += [f"vision.global.{i}.{a}" for a in VISION_LAYER_ACTIVATIONS]
    return names + ["vision.out", "projector"]


def vision_activation_names(cfg, encode_images: bool = True, image_in_cache: bool = False) -> list[str]:
    """The names of one Llama 3.2 Vision forward (`cfg` a MllamaConfig): `encode_images` for the call that is given
    the prompt's images; `image_in_cache` for later calls of a prompt that had images (decode steps)."""
    names = encoder_activation_names(cfg.vision.num_hidden_layers, cfg.vision.num_global_layers) if encode_images \
        else []
    names.append("embed")
    for i in range(cfg.text.num_hidden_layers):
        if i not in cfg.text.cross_attention_layers:
            names += [f"layers.{i}.{a}" for a in LAYER_ACTIVATIONS]
        elif encode_images:
            names += [f"layers.{i}.{a}" for a in CROSS_LAYER_ACTIVATIONS]
        elif image_in_cache:
            names += [f"layers.{i}.{a}" for a in CROSS_LAYER_ACTIVATIONS if a not in IMAGE_KV_ACTIVATIONS]
    return names + ["final_norm", "logits"]


_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")


def split_name(name: str) -> tuple[int | None, str]:
    """'layers.3.attn.q' -> (3, 'attn.q'); 'embed' -> (None, 'embed'). The kind is what plots group by."""
    m = _LAYER_RE.match(name)
    return (int(m.group(1)), m.group(2)) if m else (None, name)


def matches(name: str, patterns: list[str] | tuple[str, ...]) -> bool:
    """True if `name` matches any of the shell-style glob `patterns` (empty list: everything)."""
    return not patterns or any(fnmatch.fnmatchcase(name, p) for p in patterns)
