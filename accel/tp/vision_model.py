"""One rank's Llama 3.2 Vision forward over its shard (accel.tp.vision_load), with Megatron's collectives.

The self layers are accel.tp.model's. A cross layer on the residual stream x [T, D] (whole on every rank):
    q = rms_norm(x) · q_rᵀ                            [T, H/N, E]: this rank's heads (column-parallel)
    a = attention(q_norm(q), xk_r, xv_r, visible)     over this rank's KV heads' image keys/values [K/N, N, E]
    x += tanh(g_attn) · all_reduce(a · o_rᵀ)          row-parallel: each rank's product is a partial sum
    x += tanh(g_mlp) · has_image · all_reduce(swiglu(rms_norm(x) · gate_up_rᵀ) · down_rᵀ)
The image (`encode_images`): every rank runs the replicated encoder and projector on the same pixels (image
tokens [N, D], whole), then each cross layer's k/v of its own KV heads, [N, D] · [K/N·E, D]ᵀ, into its cache.
A prompt without an image skips the cross layers, as HF does.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from refimpl.model.llama_vision import cross_attention_rows
from refimpl.model.vision_config import MllamaConfig

from .. import ops
from ..vision import encoder
from ..vision.weights import CrossLayer
from .model import ShardCache, all_reduce, embed_rows, layer
from .vision_load import TPVisionWeights


@dataclass
class TPVisionCache:
    """The self layers' cache (ShardCache: k/v [Ls, K/N, S, E], the RoPE tables) and the image's keys/values of
    this rank's KV heads xk/xv [C, K/N, N, E] (None without an image), with the prompt's cross-attention mask
    [T0, I, A] (host) that refimpl.model.llama_vision.cross_attention_rows reads."""

    text: ShardCache
    xk: torch.Tensor | None = None
    xv: torch.Tensor | None = None
    cross_mask: np.ndarray | None = None
    image_tokens: int = 0
    decode_rows: tuple | None = None  # (visible [1, N], has_image [1, 1]) on the device: every generated token's

    @property
    def capacity(self) -> int:
        return self.text.capacity

    @property
    def has_image(self) -> bool:
        return self.image_tokens > 0


def write_image_kv(w: TPVisionWeights, cfg: MllamaConfig, local, states, cache: TPVisionCache) -> None:
    """The image tokens states [N, D] -> each cross layer's normed keys and values of this rank's KV heads.
    As accel.vision.model.write_image_kv: the RMSNorm with a unit weight rounds the normed keys to the model
    dtype before the k_norm weight multiplies them, as HF's k_norm does."""
    N, K, E = states.shape[0], local.num_key_value_heads, local.head_dim
    for c, (k_w, v_w, k_norm) in enumerate(w.image_kv):
        ones = torch.ones_like(k_norm)
        k = ops.rms_norm(F.linear(states, k_w).view(N * K, E), ones, cfg.text.rms_norm_eps)  # [N, D] -> [N·K, E]
        torch.mul(k.view(N, K, E).permute(1, 0, 2), k_norm, out=cache.xk[c])  # -> [K, N, E]
        cache.xv[c].copy_(F.linear(states, v_w).view(N, K, E).permute(1, 0, 2))  # [N, D] -> [K, N, E]


def encode_images(w: TPVisionWeights, cfg: MllamaConfig, local, pixel_values, aspect_ratio_ids, aspect_ratio_mask,
                  cache: TPVisionCache) -> None:
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


def _image_rows(cache: TPVisionCache, cfg: MllamaConfig, start: int, T: int, device):
    """(visible [T, N] bool, has_image [T, 1]) for the queries at positions start..start+T-1. A generated token
    (past the prompt's mask) reuses the prompt's last row: copied to the device once, not a host copy a step."""
    decoding = T == 1 and (cache.cross_mask is None or start >= len(cache.cross_mask))
    if decoding and cache.decode_rows is not None:
        return cache.decode_rows
    visible, row_has = cross_attention_rows(cache, np.arange(start, start + T), cfg.vision.tokens_per_tile,
                                            cache.image_tokens)
    rows = (torch.as_tensor(visible | ~row_has[:, None]).to(device), torch.as_tensor(row_has[:, None]).to(device))
    if decoding:
        cache.decode_rows = rows
    return rows


def forward(w: TPVisionWeights, cfg: MllamaConfig, local, first_id: int, world: int, ids: torch.Tensor, start: int,
            cache: TPVisionCache) -> torch.Tensor:
    """ids [T] at positions start..start+T-1 -> the last token's logits [1, V], the same on every rank.
    local: the rank's text config; first_id: the first token id of its embedding rows."""
    T = ids.shape[0]
    positions = cache.text.slots[start:start + T]  # [T]
    cos, sin = cache.text.cos[start:start + T], cache.text.sin[start:start + T]  # [T, E/2]
    x = all_reduce(embed_rows(w.text.embed, ids, first_id))  # [T, D]
    if cache.has_image:
        visible, has_image = _image_rows(cache, cfg, start, T, x.device)
        has_image = has_image.to(x.dtype)
    slot = {i: j for j, i in enumerate(w.self_layers)}
    cross = {i: c for c, i in enumerate(cfg.text.cross_attention_layers)}
    for i in range(cfg.text.num_hidden_layers):
        if i in slot:
            j = slot[i]
            x = layer(w.text.layers[j], local, x, cache.text.k[j], cache.text.v[j], cos, sin, positions)
        elif cache.has_image:
            c = cross[i]
            x = cross_layer(w.cross[c], local, x, cache.xk[c], cache.xv[c], visible, has_image)
    h = ops.rms_norm(x[-1:], w.text.norm, local.rms_norm_eps)  # [1, D]
    part = ops.linear(h, w.text.lm_head)  # [1, D] -> [1, ceil(V/N)]
    parts = [torch.empty_like(part) for _ in range(world)]
    dist.all_gather(parts, part)
    return torch.cat(parts, dim=1)[:, :cfg.vocab_size]  # [1, N·ceil(V/N)] -> [1, V]
