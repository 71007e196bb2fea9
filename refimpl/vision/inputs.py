"""The image inputs of one Llama 3.2 Vision prompt, as HF's MllamaProcessor returns them with the batch dim dropped."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from refimpl.errors import GenerationError
from refimpl.model.vision_config import VisionConfig


@dataclass(frozen=True)
class ImageInputs:
    pixel_values: np.ndarray  # [I, A, C, X, X] float32, rescaled and normalized tiles (padding tiles are zeros)
    aspect_ratio_ids: np.ndarray  # [I] int, 1-based index into supported_aspect_ratios
    aspect_ratio_mask: np.ndarray  # [I, A] int, 1 for the image's real tiles
    cross_attention_mask: np.ndarray | None = None  # [T, I, A] int, 1 where prompt token t sees tile a of image i

    @classmethod
    def from_arrays(cls, cfg: VisionConfig, pixel_values, aspect_ratio_ids, aspect_ratio_mask,
                    cross_attention_mask=None) -> "ImageInputs":
        """Check shapes and ranges against the vision config; one clear error naming the array otherwise."""
        pv = np.asarray(pixel_values, np.float32)
        A, C, X = cfg.max_num_tiles, cfg.num_channels, cfg.image_size
        if pv.ndim != 5 or pv.shape[1:] != (A, C, X, X) or pv.shape[0] == 0:
            raise GenerationError(f"pixel_values has shape {list(pv.shape)}, expected [images, {A}, {C}, {X}, {X}]")
        I = pv.shape[0]
        ids = np.asarray(aspect_ratio_ids).astype(np.int64).reshape(-1)
        if ids.shape != (I,) or not ((1 <= ids) & (ids <= cfg.max_aspect_ratio_id)).all():
            raise GenerationError(f"aspect_ratio_ids must be {I} ids in [1, {cfg.max_aspect_ratio_id}], "
                                  f"got {ids.tolist()}")
        tiles = np.asarray(aspect_ratio_mask).astype(np.int64)
        if tiles.shape != (I, A) or not (tiles[:, 0] == 1).all():
            raise GenerationError(f"aspect_ratio_mask has shape {list(tiles.shape)}, expected [{I}, {A}] with "
                                  f"each image's first tile set")
        mask = None
        if cross_attention_mask is not None:
            mask = np.asarray(cross_attention_mask).astype(np.int64)
            if mask.ndim != 3 or mask.shape[1:] != (I, A):
                raise GenerationError(f"cross_attention_mask has shape {list(mask.shape)}, expected "
                                      f"[tokens, {I}, {A}]")
        return cls(pv, ids, tiles, mask)

    @property
    def num_images(self) -> int:
        return self.pixel_values.shape[0]
