"""The training forward of Llama 3.2 Vision: LoRA on the text decoder (self- and cross-attention layers), the vision
encoder and projector frozen.

The self-attention layers are the text trainer's (accel.train.model: fused GEMMs, LoRA slices, checkpointing; its
loss over label tokens too). Each sample's images go through the fast encoder + projector once per micro-batch
under no_grad, so no activation of the vision tower is kept; its image tokens [N_b, D] are right-padded to the
batch's longest into states [B, N, D], which every cross-attention layer projects to keys/values (their LoRA
pairs train through them). Cross-attention follows HF: query row t sees the image tiles its mask row allows; a row
that sees none (text before the first image) attends to all of its own sample's image tokens and its MLP branch is
zeroed; padded image tokens are never seen, so a sample without images passes the cross layers unchanged, as HF
skips them for it. A batch without any image skips the cross layers entirely.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from accel.ops import rope_tables
from accel.train.attention import attention_reference, flash_attention
from accel.train.loop import collate
from accel.train.lora import adapted_linear, lora_group
from accel.train import fused
from accel.train.model import TrainModel, rms_norm, swiglu
from accel.vision import encoder
from accel.vision.weights import CrossLayer, VisionWeights, self_layer_config
from refimpl.model.llama_vision import TEXT, VisionCache, cross_attention_rows
from refimpl.model.vision_config import MllamaConfig
from refimpl.formats.lora_vision import TEXT_LINEARS, text_param

@torch.compiler.disable
def cross_attention(q, k, v, visible):
    """q [B, T, H, E] over k/v [B, N, K, E], visible [B, T, N] bool -> [B, T, H, E] (rows seeing nothing: 0)."""
    if q.is_cuda:
        return flash_attention(q, k, v, causal=False, mask=visible)
    return attention_reference(q, k, v, causal=False, mask=visible)


def cross_layer(x, states, visible, has_image, layer: CrossLayer, image_side: tuple, groups: tuple, shape: tuple,
                eps: float, dropout: float, kernels: bool = False):
    """One gated cross-attention layer. x [B, T, D], states [B, N, D] (the image tokens), visible [B, T, N],
    has_image [B, T, 1] in x's dtype; layer: its norms, q, o, gates, fused gate_up and down; image_side: its
    (k [K·E, D], v [K·E, D], k_norm [E]); groups = one accel.train.lora.LoraGroup or None per (q, k, v, o, gate_up,
    down); shape = (H, K, E); kernels: the Triton norm and SwiGLU Functions, as the self layers
    (accel.train.model.grouped_layer)."""
    k_w, v_w, k_norm = image_side
    aq, ak, av, ao, a_gate_up, ad = groups
    norm, act = (fused.rms_norm, fused.swiglu) if kernels else (rms_norm, swiglu)
    H, K, E = shape
    B, T, _ = x.shape
    N = states.shape[1]
    h = norm(x, layer.attn_norm, eps)
    q = norm(adapted_linear(h, layer.q, aq, dropout).view(B, T, H, E), layer.q_norm, eps)  # normed over E
    k = norm(adapted_linear(states, k_w, ak, dropout).view(B, N, K, E), k_norm, eps)
    v = adapted_linear(states, v_w, av, dropout).view(B, N, K, E)  # [B, N, D] -> [B, N, K, E]
    a = cross_attention(q, k, v, visible).reshape(B, T, H * E)  # [B, T, H, E] -> [B, T, H·E]
    x = x + layer.attn_gate.tanh() * adapted_linear(a, layer.o, ao, dropout)  # [B, T, H·E] -> [B, T, D]
    h = norm(x, layer.mlp_norm, eps)
    act_out = act(adapted_linear(h, layer.gate_up, a_gate_up, dropout))  # [B, T, D] -> [B, T, 2F] -> [B, T, F]
    down = adapted_linear(act_out, layer.down, ad, dropout)  # [B, T, F] -> [B, T, D]
    return x + layer.mlp_gate.tanh() * (down * has_image)  # full_text_row_masked_out_mask


def trainer_key(cfg: MllamaConfig, param: str) -> str:
    """The key VisionTrainModel's `lora` dict uses for a text-decoder weight (Hub name): a self-attention layer's
    linears are looked up by TrainModel under their slot among the self layers (model.layers.{slot}...), a cross
    layer's by the Hub name itself."""
    layer = int(param.removeprefix(TEXT + "layers.").split(".", 1)[0])
    t = cfg.text
    if layer in t.cross_attention_layers:
        return param
    slot = layer - sum(1 for c in t.cross_attention_layers if c < layer)
    return param.replace(f"{TEXT}layers.{layer}.", f"model.layers.{slot}.")


class VisionTrainModel(TrainModel):
    """TrainModel over the text decoder's self layers (accel's fused weights), with the cross layers and the frozen
    vision tower added; `lora` is keyed by `trainer_key`. `loss_sum(ids, labels, images)`: images is one
    refimpl.vision.inputs.ImageInputs (or None) per row of ids, as `collate` returns it."""

    def __init__(self, weights: VisionWeights, cfg: MllamaConfig, lora: dict, vision_data, dropout: float = 0.0,
                 checkpointing: bool = True, compile: bool = False):
        super().__init__(weights.text, self_layer_config(cfg), lora, dropout, checkpointing, compile)
        self.mw, self.mcfg, self.vision_data = weights, cfg, vision_data
        self.slot = {i: j for j, i in enumerate(weights.self_layers)}  # decoder layer -> its self-layer slot
        self.cross_slot = {i: c for c, i in enumerate(cfg.text.cross_attention_layers)}  # -> weights.cross[c]

    def collate(self, batch, device):
        """(ids [B, T], labels [B, T], [ImageInputs or None] per sample): the images through the processor."""
        ids, labels = collate(batch, device)
        return ids, labels, [self.vision_data.inputs(s) for s in batch]

    @torch.no_grad()
    def image_states(self, images: list, T: int, device, dtype):
        """The batch's frozen image side: (states [B, N, D], visible [B, T, N] bool, has_image [B, T, 1]), or
        None when no row has an image. One encoder pass over every image of the batch."""
        present = [im for im in images if im is not None]
        if not present:
            return None
        vcfg, p = self.mcfg.vision, self.mw.params
        pixels = torch.from_numpy(np.concatenate([im.pixel_values for im in present])).to(device, dtype)
        ar_ids = torch.from_numpy(np.concatenate([im.aspect_ratio_ids for im in present])).to(device)
        ar_mask = np.concatenate([im.aspect_ratio_mask for im in present])
        features = encoder.encode(p, vcfg, pixels, ar_ids, ar_mask, self.mw.vision_qkv,
                                  self.mw.vision_gates)  # [I, A, P, O]
        tokens = encoder.project(p, features)  # [I·A·P, D]
        per_image = vcfg.max_num_tiles * vcfg.tokens_per_tile
        counts = [0 if im is None else im.num_images * per_image for im in images]
        B, N = len(images), max(counts)
        states = tokens.new_zeros(B, N, tokens.shape[-1])  # [B, N, D], padding never visible
        visible = torch.zeros(B, T, N, dtype=torch.bool)
        has_image = torch.zeros(B, T, 1, dtype=dtype)
        start = 0
        for b, (im, n) in enumerate(zip(images, counts)):
            if im is None:
                continue
            states[b, :n] = tokens[start:start + n]
            start += n
            t = len(im.cross_attention_mask)
            rows, row_has = cross_attention_rows(VisionCache({}, {}, t, cross_mask=im.cross_attention_mask),
                                                 np.arange(t), vcfg.tokens_per_tile, n)  # [t, n], [t]
            visible[b, :t, :n] = torch.from_numpy(rows | ~row_has[:, None])
            visible[b, t:, :n] = True  # right padding: any real image token (its loss is never taken)
            has_image[b, :t, 0] = torch.from_numpy(row_has).to(dtype)
        return states, visible.to(device), has_image.to(device)

    def _cross_groups(self, i: int, dtype) -> tuple:
        """Cross layer i's LoRA groups (q, k, v, o, gate_up, down), cast from the fp32 masters (once a step,
        outside the layer's checkpoint)."""
        adapters = []
        for name in TEXT_LINEARS:
            m = self.lora.get(text_param(i, self.mcfg, name))
            adapters.append(None if m is None else (m.a, m.b, m.scale))
        aq, ak, av, ao, ag, au, ad = adapters
        dtype, Fi = self.lora_dtype or dtype, self.mcfg.text.intermediate_size
        return (*(lora_group((m,), (None,), dtype) for m in (aq, ak, av, ao)),
                lora_group((ag, au), (Fi, Fi), dtype), lora_group((ad,), (None,), dtype))

    def _cross(self, x, i: int, groups: tuple, states, visible, has_image):
        t, c = self.mcfg.text, self.cross_slot[i]
        return cross_layer(x, states, visible, has_image, self.mw.cross[c], self.mw.image_kv.layer(c), groups,
                           (t.num_attention_heads, t.num_key_value_heads, t.head_dim), t.rms_norm_eps,
                           self.dropout if self.training else 0.0, x.is_cuda and self.kernels)

    def hidden(self, ids, images=None):
        """ids [B, T], images: one ImageInputs or None per row (as `collate` gives them) -> final-norm hidden
        states [B, T, D]."""
        t = self.mcfg.text
        B, T = ids.shape
        cos, sin = rope_tables(torch.arange(T, device=ids.device), t.head_dim, t.rope_theta,
                               t.rope_scaling)  # [T, E/2] fp32 each
        x = F.embedding(ids, self.w.embed)  # [B, T, D]
        image_side = self.image_states(images or [None] * B, T, ids.device, x.dtype)
        for i in range(t.num_hidden_layers):
            if i in self.slot:
                x = self.layer(x, self.slot[i], cos, sin)  # checkpointed as the text trainer does
            elif image_side is not None:  # no image in the batch: HF skips the cross-attention layers
                args = (x, i, self._cross_groups(i, x.dtype), *image_side)
                x = checkpoint(self._cross, *args, use_reentrant=False) \
                    if self.checkpointing and torch.is_grad_enabled() else self._cross(*args)
        return rms_norm(x, self.w.norm, t.rms_norm_eps)
