"""Llama 3.2 Vision in the batched engine: each request's image keys/values, and the decoder's cross-attention layers
over a flat step.

A request with images has them encoded once, at its first prefill chunk (`ImageKV.of`: the encoder, the projector and
every cross layer's keys/values, accel.vision.model.encode_image_kv), into buffers of its own: a request's image
tokens are a fixed number (images × tiles × tokens per tile), so they stay outside the paged pool. They are dropped
when the request finishes, is aborted or is preempted (a preempted request encodes its images again when it is
readmitted: the pool's pressure says nothing about room for image buffers, so a waiting request holds none).

The layers run in the checkpoint's order: self-attention layers as accel.batch.runner runs them (the paged cache
holds the self layers only), cross-attention layers through accel.vision.model.gated_cross_layer over the rows of
every request with images at once (their q, o and MLP GEMMs read the weights once a step), each request's rows
attending to its own image keys/values with its own mask rows (prompt position p uses the prompt mask's row p,
generated tokens its last row, as HF's generate does): a plain loop over those requests. Rows of requests without
images skip a cross layer, as HF and the single-request engine do (their residual stream passes unchanged); a step
without any image rows skips the cross layers entirely. Steps with image rows run eagerly (no CUDA graph).

The image buffers are outside the paged pool: each running request with images holds 2 · C · K · N · E elements
(C cross layers, N = images × tiles × tokens per tile; image_kv_bytes). The engine keeps a share of its memory budget
for them (memory.IMAGE_KV_SHARE, or the engine's image_memory), and the scheduler admits a request with images only while
the running ones' buffers and its own fit that share; the others wait (FCFS), as they do for blocks.
"""
from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from refimpl.model.llama_vision import TEXT, VisionCache, cross_attention_rows
from refimpl.model.vision_config import MllamaConfig
from refimpl.vision.inputs import ImageInputs

from .. import ops
from ..vision.model import encode_image_kv, gated_cross_layer
from ..vision.weights import VisionWeights
from .host_copy import to_device


@dataclass
class ImageKV:
    """One request's image keys/values and its prompt's cross-attention rows."""

    xk_all: torch.Tensor  # [C, K, N, E] every cross layer's normed image keys
    xv_all: torch.Tensor  # [C, K, N, E]
    visible: torch.Tensor  # [T0, N] bool: what prompt row t sees (rows before the first image: everything)
    has_image: torch.Tensor  # [T0, 1] model dtype: 1 where row t sees an image (the MLP branch's mask)

    @classmethod
    def of(cls, w: VisionWeights, cfg: MllamaConfig, images: ImageInputs, prompt_len: int, device,
           dtype: torch.dtype) -> "ImageKV":
        t = cfg.text
        N = images.num_images * cfg.vision.max_num_tiles * cfg.vision.tokens_per_tile
        C, K, E = len(t.cross_attention_layers), t.num_key_value_heads, t.head_dim
        kv = cls(torch.empty((C, K, N, E), dtype=dtype, device=device),
                 torch.empty((C, K, N, E), dtype=dtype, device=device), None, None)
        pixels = torch.as_tensor(images.pixel_values).to(device, dtype)
        ar_ids = torch.as_tensor(images.aspect_ratio_ids).to(device)
        encode_image_kv(w, cfg, dataclasses.replace(images, pixel_values=pixels, aspect_ratio_ids=ar_ids), kv)
        rows = VisionCache({}, {}, 0, cross_mask=images.cross_attention_mask)
        visible, has = cross_attention_rows(rows, np.arange(prompt_len), cfg.vision.tokens_per_tile, N)
        kv.visible = torch.as_tensor(visible | ~has[:, None]).to(device)  # [T0, N]
        kv.has_image = torch.as_tensor(has).to(device, dtype)[:, None]  # [T0, 1]
        return kv


def image_kv_bytes(cfg: MllamaConfig, images: ImageInputs, prompt_len: int, dtype: torch.dtype) -> int:
    """What ImageKV.of allocates for a request: every cross layer's keys and values of its image tokens, and its
    prompt's cross-attention rows."""
    t = cfg.text
    N = images.num_images * cfg.vision.max_num_tiles * cfg.vision.tokens_per_tile
    kv = 2 * len(t.cross_attention_layers) * t.num_key_value_heads * N * t.head_dim * dtype.itemsize
    return kv + prompt_len * N + prompt_len * dtype.itemsize  # + visible [T0, N] bool, has_image [T0, 1]


def images_key(images: ImageInputs) -> str:
    """A digest of a request's images and cross-attention mask: the root of its blocks' prefix hashes (every self
    K/V after the first cross layer depends on them)."""
    h = hashlib.sha256()
    for a in (images.pixel_values, images.aspect_ratio_ids, images.aspect_ratio_mask, images.cross_attention_mask):
        if a is not None:
            a = np.ascontiguousarray(a)
            h.update(repr((a.dtype.str, a.shape)).encode())
            h.update(a.tobytes())
    return h.hexdigest()


@dataclass
class ImageRows:
    """One sequence's rows of a step, first..first+n-1 of the flat batch, and what they see."""

    first: int
    n: int
    kv: ImageKV
    visible: torch.Tensor  # [n, N] bool
    has_image: torch.Tensor  # [n, 1]


@dataclass
class ImageStep:
    """A step's rows of requests with images: each request's, and all of them as one index."""

    seqs: list[ImageRows]  # in row order
    index: torch.Tensor  # [R] int64: their rows in the flat batch
    has_image: torch.Tensor  # [R, 1] model dtype

    @classmethod
    def of(cls, seqs: list[ImageRows], device) -> "ImageStep | None":
        if not seqs:
            return None
        index = to_device(np.concatenate([np.arange(r.first, r.first + r.n) for r in seqs]), None, device)
        return cls(seqs, index, torch.cat([r.has_image for r in seqs]))


class VisionLayers:
    """The vision model's decoder schedule and cross-attention layers for the runner."""

    def __init__(self, w: VisionWeights, cfg: MllamaConfig, device: torch.device, dtype: torch.dtype):
        self.w, self.cfg, self.device, self.dtype = w, cfg, device, dtype
        t = cfg.text
        slot = {i: j for j, i in enumerate(w.self_layers)}
        cross = {i: c for c, i in enumerate(t.cross_attention_layers)}
        norm = lambda i: w.params[f"{TEXT}layers.{i}.input_layernorm.weight"]  # noqa: E731
        self.schedules = {}
        for with_images in (False, True):
            run = [i for i in range(t.num_hidden_layers) if with_images or i not in cross]
            norms = [norm(i) for i in run] + [w.params[TEXT + "norm.weight"]]
            self.schedules[with_images] = (norms[0], [(slot.get(i), cross.get(i), norms[n + 1])
                                                      for n, i in enumerate(run)])

    def schedule(self, with_images: bool):
        """(the first layer's input norm, [(self slot j or None, cross index c or None, next norm)])."""
        return self.schedules[with_images]

    def encode(self, images: ImageInputs, prompt_len: int) -> ImageKV:
        return ImageKV.of(self.w, self.cfg, images, prompt_len, self.device, self.dtype)

    @staticmethod
    def rows(kv: ImageKV, first: int, start: int, n: int) -> ImageRows:
        """Rows first.. of the step: the sequence's positions start..start+n-1."""
        T0 = kv.visible.shape[0]
        idx = torch.clamp(torch.arange(start, start + n, device=kv.visible.device), max=T0 - 1)
        return ImageRows(first, n, kv, kv.visible[idx], kv.has_image[idx])

    def cross(self, c: int, x, h, next_norm, step: ImageStep):
        """Cross layer c over the step's x [T, D] and h = its input norm -> (x, next_norm(x)): the rows of the
        requests with images through the layer, each attending to its own request's images; every other row
        passing unchanged."""
        t, cl = self.cfg.text, self.w.cross[c]
        eps = t.rms_norm_eps
        out = ops.rms_norm(x, next_norm, eps)  # [T, D]: the rows that skip the layer

        def attend(q):  # [R, H, E] -> [R, H, E]
            a = torch.empty_like(q)
            for r, (lo, hi) in zip(step.seqs, _spans(step.seqs)):
                a[lo:hi] = ops.norm_cross_attention(q[lo:hi], cl.q_norm, eps, r.kv.xk_all[c], r.kv.xv_all[c],
                                                    r.visible)
            return a
        xi, hi = gated_cross_layer(cl, t, x[step.index], h[step.index], next_norm, step.has_image, attend)
        return x.index_copy_(0, step.index, xi), out.index_copy_(0, step.index, hi)


def _spans(seqs: list[ImageRows]) -> list[tuple[int, int]]:
    """Each request's rows within the gathered image rows."""
    ends = np.cumsum([r.n for r in seqs])
    return list(zip([0, *ends[:-1].tolist()], ends.tolist()))
