"""TPVisionEngine: Llama 3.2 Vision generation over a tensor-parallel group (accel.tp.engine's protocol).

A request with images is op IMAGES instead of GENERATE: after [IMAGES, prompt length, cache size] rank 0
broadcasts the images' shape [I, A, C, X, has a cross-attention mask], the pixels (float32 [I, A, C, X, X]) and
the integers (aspect_ratio_ids [I], aspect_ratio_mask [I·A], the mask [T·I·A] if any), then the prompt ids as for
any request. Every rank encodes the images itself (the encoder is replicated, accel.tp.vision_load says why) and
writes its KV heads' image keys/values into its cache; then rank 0 leads and the others follow, token by token,
as for a text model.

The prompt runs the eager forward (accel.tp.vision_model), which also writes the decode step's mask row and gates;
each generated token runs accel.vision.model.decode_step, the one-GPU engine's fused step, over the rank's shard
with RankSplit's collectives, replayed as one CUDA graph a token on the GPU (the cross layers in it when the
request has an image). A session (cache + captured step) is kept for the next request of the same image slots
that fits in it, as TPEngine keeps a text one.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from refimpl.errors import GenerationError
from refimpl.generate import Sampling, check_prompt
from refimpl.generate_vision import check_images
from refimpl.model.vision_config import MllamaConfig
from refimpl.quant.schemes import QuantSpec
from refimpl.vision.inputs import ImageInputs

from .. import ops
from ..engine import check_fits
from ..vision.model import VisionStaticCache, decode_step
from .engine import ShardSession, TPEngine
from .group import TPGroup
from .model import RankSplit
from .shard import element_bytes
from .vision_load import TPVisionWeights, VisionShardPlan, load_vision_shard, open_vision_checkpoint, \
    vision_shard_elements
from .vision_model import encode_images, forward

IMAGES = 4


class TPVisionEngine(TPEngine):
    def __init__(self, group: TPGroup, cfg: MllamaConfig, weights: TPVisionWeights, dtype: str):
        super().__init__(group, cfg.text, weights.text, dtype)
        self.plan = VisionShardPlan(cfg, group.rank, group.world)
        self.config, self.vision_weights = cfg, weights

    @staticmethod
    def load_shard(group: TPGroup, model_dir: Path, dtype: torch.dtype, quant: QuantSpec | None):
        """(the whole model's config, this rank's weights) of a Llama 3.2 Vision directory."""
        cfg = open_vision_checkpoint(model_dir, with_tokenizer=False, world=group.world).config
        plan = VisionShardPlan(cfg, group.rank, group.world)
        check_fits(group.device, vision_shard_elements(plan) * element_bytes(dtype, quant),
                   f"rank {group.rank}'s shard of {model_dir}")
        return cfg, load_vision_shard(model_dir, plan, group.device, dtype, quant)

    # ---- every rank ----
    def image_tokens(self, num_images: int) -> int:
        v = self.config.vision
        return num_images * v.max_num_tiles * v.tokens_per_tile

    def alloc_cache(self, capacity: int, image_tokens: int = 0) -> ShardSession:
        """This rank's cache (its KV heads' self-attention slots, and image keys/values for `image_tokens`) and
        the decode step over it, captured before anything is written to the cache (as TPEngine.alloc_cache)."""
        cache = VisionStaticCache.allocate(self.local, capacity, image_tokens, self.dtype, self.device)
        cache.image_tokens = image_tokens  # the decode step's schedule: the cross layers only with an image
        return ShardSession(cache, self._decoder(cache), image_tokens)

    def rank_split(self) -> RankSplit:
        return RankSplit(self.group.rank, self.group.world, self.plan.embed_range()[0], self.config.vocab_size)

    def decode_fn(self, cache: VisionStaticCache):
        """accel.vision.model.decode_step over this rank's shard (its local text config), RankSplit's collectives."""
        split, w, tuning = self.rank_split(), self.vision_weights, self.tuning
        cfg = dataclasses.replace(self.config, text=self.local)

        def step(token, position):
            return decode_step(w, cfg, token, position, cache, tuning, split)
        return step

    def forward(self, ids: torch.Tensor, start: int, sess: ShardSession) -> torch.Tensor:
        """As TPEngine.forward, but an image request's prompt always runs the eager forward (one token too): it
        writes the decode step's mask row and gates."""
        if ids.shape[0] == 1 and (start > 0 or not sess.cache.has_image):
            return sess.decoder.step(ids, start)
        return self.prefill(ids, start, sess)

    def prefill(self, ids: torch.Tensor, start: int, sess: ShardSession) -> torch.Tensor:
        """The eager forward (accel.tp.vision_model.forward) of ids [T] at positions start.. -> the gathered
        logits [1, V] of the last one."""
        first_id, _ = self.plan.embed_range()
        with ops.torch_only(not self.triton):
            return forward(self.vision_weights, self.config, self.local, first_id, self.group.world, ids, start,
                           sess.cache)

    def _share_images(self, images: ImageInputs | None, T: int):
        """Rank 0's images (None elsewhere) on every rank -> (pixels [I, A, C, X, X] float32 on the device,
        aspect_ratio_ids [I] on the device, aspect_ratio_mask [I, A] and the cross-attention mask [T, I, A] or None
        on the host)."""
        head = None
        if images is not None:
            head = [*images.pixel_values.shape[:4], int(images.cross_attention_mask is not None)]
        I, A, C, X, has_mask = self._broadcast(head, 5).tolist()
        pixels = torch.empty((I, A, C, X, X), dtype=torch.float32, device=self.device)
        if images is not None:
            pixels.copy_(torch.as_tensor(images.pixel_values, dtype=torch.float32))
        dist.broadcast(pixels, src=0)
        ints = None
        if images is not None:
            parts = [images.aspect_ratio_ids, images.aspect_ratio_mask]
            parts += [images.cross_attention_mask] if has_mask else []
            ints = np.concatenate([np.asarray(p, np.int64).reshape(-1) for p in parts]).tolist()
        ints = self._broadcast(ints, I + I * A + has_mask * T * I * A).cpu().numpy()
        mask = ints[I + I * A:].reshape(T, I, A) if has_mask else None
        return pixels, torch.as_tensor(ints[:I], device=self.device), ints[I:I + I * A].reshape(I, A), mask

    def image_request(self, images: ImageInputs | None, n: int, capacity: int) -> ShardSession:
        """Every rank's side of an IMAGES request (rank 0 passes the images, the others None): the images shared,
        a session with their image slots (the last one if it fits), the images encoded and their keys/values
        cached -> the session."""
        pixels, ratio_ids, ratio_mask, mask = self._share_images(images, n)
        sess = self.session(capacity, self.image_tokens(pixels.shape[0]))
        with ops.torch_only(not self.triton):
            encode_images(self.vision_weights, self.config, self.local, pixels.to(self.dtype), ratio_ids,
                          ratio_mask, sess.cache)
        sess.cache.cross_mask = mask
        return sess

    # ---- ranks 1..N-1 ----
    def follow_request(self, op: int, n: int, number: int) -> None:
        if op != IMAGES:
            return super().follow_request(op, n, number)
        sess = self.image_request(None, n, number)
        self._follow(self._broadcast(None, n), sess, 0)

    # ---- rank 0 ----
    def generate(self, prompt_ids: list[int], s: Sampling, stop_ids=(), cache: ShardSession | None = None,
                 start: int = 0, images: ImageInputs | None = None):
        """refimpl.generate_vision.VisionEngine.generate's contract; with `cache` (new_cache's, text turns only)
        the prompt continues it from `start`."""
        cfg = self.config
        if cache is not None and (cache is not self.kept or images is not None):
            raise GenerationError("a tensor-parallel engine continues in the cache new_cache made last only, "
                                  "without images")
        context = cfg.max_position_embeddings if cache is None else cache.capacity
        check_prompt(prompt_ids, cfg.text.embedding_rows, s.max_new_tokens, context, start)
        check_images(prompt_ids, cfg.image_token_index, images)
        if images is None:
            yield from super().generate(prompt_ids, s, stop_ids, cache, start)
            return
        if s.max_new_tokens < 1:
            return
        capacity = len(prompt_ids) + s.max_new_tokens
        self._broadcast([IMAGES, len(prompt_ids), capacity], 3)
        sess = self.image_request(images, len(prompt_ids), capacity)
        ids = self._broadcast(prompt_ids, len(prompt_ids))
        yield from self._lead(ids, sess, 0, s, set(stop_ids))
