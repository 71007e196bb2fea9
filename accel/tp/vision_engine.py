"""TPVisionEngine: Llama 3.2 Vision generation over a tensor-parallel group (accel.tp.engine's protocol).

A request with images is op IMAGES instead of GENERATE: after [IMAGES, prompt length, cache size] rank 0
broadcasts the images' shape [I, A, C, X, has a cross-attention mask], the pixels (float32 [I, A, C, X, X]) and
the integers (aspect_ratio_ids [I], aspect_ratio_mask [I·A], the mask [T·I·A] if any), then the prompt ids as for
any request. Every rank encodes the images itself (the encoder is replicated, accel.tp.vision_load says why) and
writes its KV heads' image keys/values into its cache; then rank 0 leads and the others follow, token by token,
as for a text model.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from refimpl.errors import GenerationError
from refimpl.generate import Sampling, check_prompt
from refimpl.generate_vision import check_images
from refimpl.model import ops as np_ops
from refimpl.model.vision_config import MllamaConfig
from refimpl.quant.schemes import QuantSpec
from refimpl.vision.inputs import ImageInputs

from .. import ops
from ..engine import check_fits
from .engine import CONTINUE, GENERATE, KEEP, STOP, TPEngine
from .group import TPGroup
from .model import ShardCache
from .shard import element_bytes
from .vision_load import TPVisionWeights, VisionShardPlan, load_vision_shard, open_vision_checkpoint, \
    vision_shard_elements
from .vision_model import TPVisionCache, encode_images, forward

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

    def alloc_cache(self, capacity: int, image_tokens: int = 0) -> TPVisionCache:
        """This rank's cache: its KV heads' self-attention slots and image keys/values."""
        c, C = self.local, len(self.config.text.cross_attention_layers)
        K, E = c.num_key_value_heads, c.head_dim
        shape = (len(self.vision_weights.self_layers), K, capacity, E)  # [Ls, K/N, S, E]
        cos, sin = np_ops.rope_tables(np.arange(capacity), E, c.rope_theta, c.rope_scaling)
        zeros = lambda s: torch.zeros(s, dtype=self.dtype, device=self.device)  # noqa: E731
        text = ShardCache(zeros(shape), zeros(shape), torch.from_numpy(cos).to(self.device),
                          torch.from_numpy(sin).to(self.device), torch.arange(capacity, device=self.device))
        if not image_tokens:
            return TPVisionCache(text)
        return TPVisionCache(text, zeros((C, K, image_tokens, E)), zeros((C, K, image_tokens, E)))  # [C, K/N, N, E]

    def forward(self, ids: torch.Tensor, start: int, cache: TPVisionCache) -> torch.Tensor:
        first_id, _ = self.plan.embed_range()
        with ops.torch_only(not self.triton):
            return forward(self.vision_weights, self.config, self.local, first_id, self.group.world, ids, start,
                           cache)

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

    def image_request(self, images: ImageInputs | None, n: int, capacity: int) -> TPVisionCache:
        """Every rank's side of an IMAGES request (rank 0 passes the images, the others None): the images shared,
        encoded, their keys/values cached -> the request's cache."""
        pixels, ratio_ids, ratio_mask, mask = self._share_images(images, n)
        cache = self.alloc_cache(capacity, self.image_tokens(pixels.shape[0]))
        with ops.torch_only(not self.triton):
            encode_images(self.vision_weights, self.config, self.local, pixels.to(self.dtype), ratio_ids,
                          ratio_mask, cache)
        cache.cross_mask, cache.image_tokens = mask, cache.xk.shape[2]
        return cache

    # ---- ranks 1..N-1 ----
    def serve(self) -> None:
        """Follow rank 0's requests until it sends STOP."""
        while True:
            op, n, number = self._broadcast(None, 3).tolist()
            if op == STOP:
                return
            if op == KEEP:
                self.kept = self.alloc_cache(number)
            elif op == GENERATE:
                self._follow(self._broadcast(None, n), self.alloc_cache(number), 0)
            elif op == IMAGES:
                cache = self.image_request(None, n, number)
                self._follow(self._broadcast(None, n), cache, 0)
            else:
                assert op == CONTINUE
                self._follow(self._broadcast(None, n), self.kept, number)

    # ---- rank 0 ----
    def generate(self, prompt_ids: list[int], s: Sampling, stop_ids=(), cache: TPVisionCache | None = None,
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
        cache = self.image_request(images, len(prompt_ids), capacity)
        ids = self._broadcast(prompt_ids, len(prompt_ids))
        yield from self._lead(ids, cache, 0, s, set(stop_ids))
