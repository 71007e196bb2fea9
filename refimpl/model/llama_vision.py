"""The Llama 3.2 Vision forward (HF's MllamaForConditionalGeneration), written over the op interface.

The text decoder is Llama's (the self-attention layers reuse `refimpl.model.llama`'s blocks) with gated
cross-attention layers at `cross_attention_layers`: queries from the text (RMSNorm'd per head), keys and values
from the projected image tokens (computed once per image, then kept in the cache for every decode step), no RoPE,
and tanh gates on the attention and MLP branches. A prompt without an image skips those layers, as HF does.

Like `llama.forward_steps`, `forward_steps` yields every named activation (`refimpl.model.names`) and accepts a
replacement value sent back. Parameters use the Hub checkpoint's names (`language_model.model.layers.3.cross_attn.
q_proj.weight`, `vision_model.*`, `multi_modal_projector.*`; `refimpl.formats.vision_checkpoint` normalises others).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from refimpl.model import arrays
from refimpl.model.llama import Steps, attention_block, emit, layer_params, mlp_block, mlp_branch, run_steps
from refimpl.model.llama import project as linear  # x @ wᵀ, or an unmerged LoRA sum (generate --lora-mode unmerged)
from refimpl.model.vision_config import MllamaConfig, MllamaTextConfig
from refimpl.vision.encoder import project, vision_steps
from refimpl.vision.inputs import ImageInputs

TEXT = "language_model.model."
LM_HEAD = "language_model.lm_head.weight"
CROSS_LAYER_KEYS = ("input_layernorm.weight", "cross_attn.q_proj.weight", "cross_attn.k_proj.weight",
                    "cross_attn.v_proj.weight", "cross_attn.o_proj.weight", "cross_attn.q_norm.weight",
                    "cross_attn.k_norm.weight", "cross_attn_attn_gate", "post_attention_layernorm.weight",
                    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "cross_attn_mlp_gate")


@dataclass
class VisionCache:
    """Self-attention layers' caches k[i]/v[i] [K, S, E]; cross-attention layers' image keys/values xk[i]/xv[i]
    [K, N, E], written when the image is encoded; the prompt's cross-attention mask rows [T0, I, A]."""

    k: dict
    v: dict
    capacity: int
    xk: dict = field(default_factory=dict)
    xv: dict = field(default_factory=dict)
    cross_mask: np.ndarray | None = None
    image_tokens: int = 0  # N; 0 until an image is encoded

    @classmethod
    def allocate(cls, cfg: MllamaTextConfig, capacity: int, zeros: Callable) -> "VisionCache":
        shape = (cfg.num_key_value_heads, capacity, cfg.head_dim)  # [K, S, E]
        self_layers = [i for i in range(cfg.num_hidden_layers) if i not in cfg.cross_attention_layers]
        return cls({i: zeros(shape) for i in self_layers}, {i: zeros(shape) for i in self_layers}, capacity)

    @property
    def has_image(self) -> bool:
        return self.image_tokens > 0


def cross_attention_rows(cache: VisionCache, positions, tokens_per_tile: int, N: int):
    """(visible [T, N] bool, row_has_image [T] bool) for the queries at `positions`.

    Position p uses row p of the prompt's mask; generated tokens reuse its last row (HF's generate does so).
    """
    T = len(positions)
    if cache.cross_mask is None:
        return np.ones((T, N), bool), np.ones(T, bool)
    rows = cache.cross_mask[np.minimum(positions, len(cache.cross_mask) - 1)]  # [T0, I, A][T] -> [T, I, A]
    visible = np.repeat(rows.reshape(T, -1), tokens_per_tile, axis=1) != 0  # [T, I·A] -> [T, I·A·P] = [T, N]
    return visible, visible.any(axis=1)


def cross_attention_block(ops, p: dict, x, cfg: MllamaTextConfig, i: int, cache: VisionCache, states,
                          visible, row_has_image) -> Steps:
    n = f"layers.{i}."
    T, H, K, E = x.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    eps = cfg.rms_norm_eps
    h = yield from emit(n + "xattn_norm", ops.rms_norm(x, p["input_layernorm.weight"], eps))
    q = linear(ops, h, p["cross_attn.q_proj.weight"]).reshape(T, H, E)  # [T, D] -> [T, H, E]
    q = yield from emit(n + "xattn.q", q)
    q = yield from emit(n + "xattn.q_norm", ops.rms_norm(q, p["cross_attn.q_norm.weight"], eps))  # over E
    if states is not None:  # a new image: its keys/values replace the cached ones
        N = states.shape[0]
        k = linear(ops, states, p["cross_attn.k_proj.weight"]).reshape(N, K, E)  # [N, D] -> [N, K, E]
        k = yield from emit(n + "xattn.k", k)
        k = yield from emit(n + "xattn.k_norm", ops.rms_norm(k, p["cross_attn.k_norm.weight"], eps))
        v = linear(ops, states, p["cross_attn.v_proj.weight"]).reshape(N, K, E)  # [N, D] -> [N, K, E]
        v = yield from emit(n + "xattn.v", v)
        cache.xk[i], cache.xv[i] = arrays.permute(k, (1, 0, 2)), arrays.permute(v, (1, 0, 2))  # -> [K, N, E]
    # HF multiplies the additive mask by full_text_row_masked_out_mask: a token that may see no tile (text before
    # the first image) attends to every image token instead, and only its MLP branch is zeroed below.
    a = ops.cross_attention(q, cache.xk[i], cache.xv[i], visible | ~row_has_image[:, None])  # -> [T, H, E]
    a = yield from emit(n + "xattn.out", a)
    o = linear(ops, a.reshape(T, H * E), p["cross_attn.o_proj.weight"])  # [T, H·E] -> [T, D]
    o = yield from emit(n + "xattn.o_proj", o)
    x = yield from emit(n + "resid_mid", x + arrays.tanh(p["cross_attn_attn_gate"]) * o)
    down = yield from mlp_branch(ops, p, x, cfg, i)  # [T, D]
    down = arrays.scale_rows(down, row_has_image)  # full_text_row_masked_out_mask
    return (yield from emit(n + "resid_post", x + arrays.tanh(p["cross_attn_mlp_gate"]) * down))


def cross_layer_params(params: dict, i: int) -> dict:
    return {key: params[f"{TEXT}layers.{i}.{key}"] for key in CROSS_LAYER_KEYS}


def image_states(ops, params: dict, cfg: MllamaConfig, images: ImageInputs) -> Steps:
    """Encode the images and project them: the image tokens [N, D] every cross-attention layer reads."""
    features = yield from vision_steps(ops, params, cfg.vision, images.pixel_values, images.aspect_ratio_ids,
                                       images.aspect_ratio_mask)  # [I, A, P, O]
    return (yield from project(ops, params, features))  # [N, D]


def forward_steps(ops, params: dict, cfg: MllamaConfig, ids, positions, cache: VisionCache,
                  images: ImageInputs | None = None, last_logits_only: bool = False) -> Steps:
    """ids [T], positions [T]; `images` for the call that first sees them (the prompt). Returns logits [T, V]."""
    text = cfg.text
    states = None
    if images is not None:
        states = yield from image_states(ops, params, cfg, images)
        cache.cross_mask, cache.image_tokens = images.cross_attention_mask, states.shape[0]
    x = yield from emit("embed", ops.embedding(ids, params[TEXT + "embed_tokens.weight"]))  # [T, D]
    cos, sin = ops.rope_tables(positions, text.head_dim, text.rope_theta, text.rope_scaling)  # [T, E/2] each
    if cache.has_image:
        visible, row_has_image = cross_attention_rows(cache, np.asarray(positions), cfg.vision.tokens_per_tile,
                                                      cache.image_tokens)
    for i in range(text.num_hidden_layers):
        if i in text.cross_attention_layers:
            if not cache.has_image:
                continue  # no image anywhere: HF skips the cross-attention layers entirely
            x = yield from cross_attention_block(ops, cross_layer_params(params, i), x, text, i, cache, states,
                                                 visible, row_has_image)
        else:
            p = layer_params(params, i, prefix=TEXT + "layers.")
            x = yield from attention_block(ops, p, x, text, i, cos, sin, cache, positions)
            x = yield from mlp_block(ops, p, x, text, i)
    x = yield from emit("final_norm", ops.rms_norm(x, params[TEXT + "norm.weight"], text.rms_norm_eps))
    if last_logits_only:
        x = x[-1:]
    return (yield from emit("logits", linear(ops, x, params[LM_HEAD])))  # [T, D] -> [T, V]


def forward(ops, params, cfg, ids, positions, cache, images=None, last_logits_only=False):
    return run_steps(forward_steps(ops, params, cfg, ids, positions, cache, images, last_logits_only))
