"""VisionAccelEngine: Llama 3.2 Vision on accel, with refimpl.generate_vision.VisionEngine's contract.

    fast   the encoder with every tile batched (accel.vision.encoder), the image keys/values of every cross layer
           computed once per request into static buffers, then accel.vision.model's prefill and decode step; the
           decode step (cross layers included) replays one CUDA graph per token, as the text engine's does;
    trace  `steps()`: refimpl.model.llama_vision.forward_steps over accel.ops with torch tensors, yielding every
           activation by the one name scheme (golden check, diff, step --backend both).
"""
from __future__ import annotations

import dataclasses
from typing import Iterator

import numpy as np
import torch

from refimpl.errors import GenerationError
from refimpl.formats.params import Checkpoint
from refimpl.generate import Sampling, check_prompt
from refimpl.generate_vision import check_images
from refimpl.model.llama_vision import forward_steps
from refimpl.model.vision_config import MllamaConfig
from refimpl.vision.inputs import ImageInputs

from .. import ops
from ..engine import AccelEngine, Decoder, DecodeSession, check_fits, resolve_device, resolve_dtype
from ..kernels.tuning import DEFAULT, Tuning
from ..weights import DTYPES
from . import model as vision_fast
from .model import VisionStaticCache
from .weights import VisionWeights, load_vision_weights


class VisionAccelEngine(AccelEngine):
    def __init__(self, config: MllamaConfig, weights: VisionWeights, device: torch.device, dtype: str,
                 use_graph: bool | None = None, use_triton: bool | None = None, tuning: Tuning = DEFAULT):
        super().__init__(config, weights, device, dtype, use_graph, use_triton, tuning)
        self._session_images = 0  # N of the session's image buffers (0: none)

    def trace_params(self) -> dict:
        """Trace mode's parameters: the checkpoint's names (VisionWeights keeps them)."""
        return self.weights.params

    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint, device: str | None = None, dtype: str | None = None,
                        quant=None, **options) -> "VisionAccelEngine":
        if quant is not None:
            raise GenerationError("--quant runs on text models only for now; drop it for a Llama 3.2 Vision checkpoint")
        dev = resolve_device(device)
        dtype = resolve_dtype(dtype, dev)
        size = sum(a.size for a in ckpt.params.values()) * DTYPES[dtype].itemsize
        check_fits(dev, size, f"the weights of {ckpt.path} in {dtype}")
        return cls(ckpt.config, load_vision_weights(ckpt.params, ckpt.config, dev, DTYPES[dtype]), dev, dtype,
                   **options)

    # ---- the engine contract ----
    def new_cache(self, capacity: int, image_tokens: int = 0) -> VisionStaticCache:
        """Self-attention caches for `capacity` positions; image buffers for `image_tokens` (fast path only:
        trace mode keeps each image's keys/values as its own tensors)."""
        t = self.config.text
        if not 0 < capacity <= t.max_position_embeddings:
            raise GenerationError(f"cache capacity {capacity} is outside [1, {t.max_position_embeddings}] "
                                  f"(the model's max_position_embeddings)")
        K, E, size = t.num_key_value_heads, t.head_dim, self.dtype.itemsize
        Ls, C = len(self.weights.self_layers), len(t.cross_attention_layers)
        need = 2 * (Ls * capacity + C * image_tokens) * K * E * size
        check_fits(self.device, need, f"a KV cache of {capacity} positions and {image_tokens} image tokens")
        return VisionStaticCache.allocate(t, capacity, image_tokens, self.dtype, self.device)

    def _device_images(self, images: ImageInputs) -> ImageInputs:
        """The pixels and aspect-ratio ids as device tensors (kept if they are already); the masks stay host
        arrays (they build masks)."""
        pixels = torch.as_tensor(images.pixel_values).to(self.device, self.dtype)
        return dataclasses.replace(images, pixel_values=pixels,
                                   aspect_ratio_ids=torch.as_tensor(images.aspect_ratio_ids).to(self.device))

    def steps(self, ids, positions, cache: VisionStaticCache, last_logits_only: bool = False,
              images: ImageInputs | None = None):
        """Trace mode: refimpl's Mllama forward over accel.ops, yielding (name, torch tensor)."""
        ids = torch.as_tensor(np.asarray(ids, np.int64), device=self.device)
        positions = torch.as_tensor(np.asarray(positions, np.int64))  # host: the cross-attention rows index by it
        images = None if images is None else self._device_images(images)
        return forward_steps(ops, self.params, self.config, ids, positions, cache, images, last_logits_only)

    def check_prompt(self, prompt_ids: list[int], s: Sampling, images: ImageInputs | None = None) -> None:
        cfg = self.config
        check_prompt(prompt_ids, cfg.text.embedding_rows, s.max_new_tokens, cfg.max_position_embeddings)
        check_images(prompt_ids, cfg.image_token_index, images)

    # ---- the fast path ----
    def image_tokens(self, images: ImageInputs | None) -> int:
        return 0 if images is None else images.num_images * self.config.vision.max_num_tiles * \
            self.config.vision.tokens_per_tile

    def session(self, capacity: int, image_tokens: int = 0) -> DecodeSession:
        """A cache of at least `capacity` slots with exactly `image_tokens` image slots, and its decoder."""
        s = self._session
        if s is None or s.capacity < capacity or self._session_images != image_tokens:
            self._session = None  # free the old cache and graph first
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            cache = self.new_cache(capacity, image_tokens)
            cache.image_tokens = image_tokens  # the decode step's schedule: cross layers only with an image
            w, cfg, tuning = self.weights, self.config, self.tuning

            def step_fn(token, position):
                return vision_fast.decode_step(w, cfg, token, position, cache, tuning)
            self._session = DecodeSession(cache, Decoder(self, cache, self.use_graph, step_fn))
            self._session_images = image_tokens
        return self._session

    def encode_images(self, images: ImageInputs, cache: VisionStaticCache) -> None:
        """Encoder + projector + every cross layer's image keys/values, into the cache's image buffers."""
        im = self._device_images(images)
        with ops.torch_only(not self.triton):
            vision_fast.encode_image_kv(self.weights, self.config, im, cache)
        cache.cross_mask = images.cross_attention_mask

    def prefill(self, prompt_ids, sess: DecodeSession, images: ImageInputs | None = None) -> torch.Tensor:
        """Encode the images (if any), then the prompt at positions 0..T-1 -> next-token logits [1, V]."""
        ids = torch.as_tensor(prompt_ids, dtype=torch.int64, device=self.device)
        cache = sess.cache
        if images is not None:
            self.encode_images(images, cache)
        with ops.torch_only(not self.triton):
            return vision_fast.prefill(self.weights, self.config, ids, cache)

    def generate(self, prompt_ids: list[int], s: Sampling, stop_ids=(),
                 images: ImageInputs | None = None) -> Iterator[int]:
        self.check_prompt(prompt_ids, s, images)
        sess = self.session(len(prompt_ids) + s.max_new_tokens, self.image_tokens(images))
        yield from self._sample_loop(sess, self.prefill(prompt_ids, sess, images), prompt_ids, s, stop_ids)
