"""Llama 3.2 Vision image preprocessing, pixel for pixel as HF's `MllamaImageProcessor` (its PIL backend).

One image becomes a canvas of up to `max_image_tiles` square tiles of X×X pixels:
    1. choose the tile arrangement (rows × columns) whose canvas needs the smallest upscale, or else the smallest
       downscale; equal scales go to the smaller canvas;
    2. resize with aspect ratio kept (PIL, the file's `resample`, bilinear by default) so the image fits the canvas
       and no side is below one tile;
    3. zero-pad bottom and right to the canvas, rescale by 1/255, normalize with the file's mean/std;
    4. cut the canvas into tiles, row by row.
A prompt's images are stacked as pixel_values [I, A, C, X, X] (C = 3) (unused tile slots zero), with aspect_ratio_ids
[I] (1-based index of the arrangement in `supported_aspect_ratios`) and aspect_ratio_mask [I, A].
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from refimpl.errors import ConfigError
from refimpl.formats.jsonfile import read_json_object

# HF's class defaults, used for keys a preprocessor_config.json leaves out
DEFAULT_MEAN = (0.5, 0.5, 0.5)
DEFAULT_STD = (0.5, 0.5, 0.5)
BILINEAR = 2  # PIL.Image.Resampling.BILINEAR


@dataclass(frozen=True)
class ImageProcessorConfig:
    """The fields of preprocessor_config.json that change pixels; names are HF's."""

    tile_size: int = 224  # size.height == size.width
    max_image_tiles: int = 4
    resample: int = BILINEAR
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, float, float] = DEFAULT_MEAN
    image_std: tuple[float, float, float] = DEFAULT_STD
    do_convert_rgb: bool = True

    @classmethod
    def from_dict(cls, d: dict, source: str = "preprocessor_config.json") -> "ImageProcessorConfig":
        def field(key, kind, default):
            value = d.get(key, default)
            if value is None:
                value = default
            if kind is bool and not isinstance(value, bool):
                raise ConfigError(f"{source}: {key} must be true or false, got {value!r}")
            if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
                raise ConfigError(f"{source}: {key} must be an integer, got {value!r}")
            if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise ConfigError(f"{source}: {key} must be a number, got {value!r}")
            return value

        # MllamaImageProcessor has no do_resize=False or do_pad=False mode: every image lands on a tile canvas
        for key in ("do_resize", "do_pad"):
            if field(key, bool, True) is not True:
                raise ConfigError(f"{source}: {key} must be true (Mllama always resizes and pads to tiles)")
        size = d.get("size", {"height": 224, "width": 224})
        if not (isinstance(size, dict) and isinstance(size.get("height"), int) and size.get("height") > 0
                and size.get("height") == size.get("width")):
            raise ConfigError(f"{source}: size must be {{\"height\": P, \"width\": P}} with one positive P "
                              f"(square tiles), got {size!r}")
        tiles = field("max_image_tiles", int, 4)
        if tiles <= 0:
            raise ConfigError(f"{source}: max_image_tiles must be a positive integer, got {tiles}")
        resample = field("resample", int, BILINEAR)
        if resample not in range(6):
            raise ConfigError(f"{source}: resample must be a PIL filter code 0..5, got {resample}")

        def triple(key, default):
            value = d.get(key, default)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                value = [value] * 3
            if not (isinstance(value, (list, tuple)) and len(value) == 3
                    and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)):
                raise ConfigError(f"{source}: {key} must be 3 numbers (one per RGB channel), got {value!r}")
            return tuple(float(v) for v in value)

        std = triple("image_std", DEFAULT_STD)
        if 0.0 in std:
            raise ConfigError(f"{source}: image_std has a zero, normalizing would divide by it")
        return cls(tile_size=size["height"], max_image_tiles=tiles, resample=resample,
                   do_rescale=field("do_rescale", bool, True), rescale_factor=field("rescale_factor", float, 1 / 255),
                   do_normalize=field("do_normalize", bool, True), image_mean=triple("image_mean", DEFAULT_MEAN),
                   image_std=std, do_convert_rgb=field("do_convert_rgb", bool, True))

    @classmethod
    def from_dir(cls, model_dir: Path) -> "ImageProcessorConfig":
        path = Path(model_dir) / "preprocessor_config.json"
        return cls.from_dict(read_json_object(path, "the image processor settings of a vision checkpoint"),
                             str(path))


@dataclass
class ImageBatch:
    """One prompt's images, as the vision encoder takes them."""

    pixel_values: np.ndarray  # [I, A, C, X, X] float32, tile slots past num_tiles[i] are zero
    aspect_ratio_ids: np.ndarray  # [I] int64, 1-based index into supported_aspect_ratios(A)
    aspect_ratio_mask: np.ndarray  # [I, A] int64, 1 for the image's tiles
    num_tiles: list[int]  # tiles used by each image


def supported_aspect_ratios(max_image_tiles: int) -> list[tuple[int, int]]:
    """Every (rows, columns) arrangement of at most max_image_tiles tiles, rows-major: (1,1), (1,2), ..."""
    return [(rows, cols) for rows in range(1, max_image_tiles + 1) for cols in range(1, max_image_tiles + 1)
            if rows * cols <= max_image_tiles]


def optimal_canvas(height: int, width: int, max_image_tiles: int, tile_size: int) -> tuple[int, int]:
    """(canvas height, canvas width) in pixels: the arrangement needing the least upscale (an image shown at
    full size or larger), else the least downscale; among equal scales the smallest area (the first on a tie)."""
    canvases = [(rows * tile_size, cols * tile_size) for rows, cols in supported_aspect_ratios(max_image_tiles)]
    # the image fits a canvas after scaling by the tighter of the two sides' ratios
    scales = [min(ch / height, cw / width) for ch, cw in canvases]
    upscales = [s for s in scales if s >= 1]
    chosen = min(upscales) if upscales else max(scales)
    candidates = [c for c, s in zip(canvases, scales) if s == chosen]
    return min(candidates, key=lambda c: c[0] * c[1])


def fit_to_canvas(height: int, width: int, canvas_height: int, canvas_width: int,
                  tile_size: int) -> tuple[int, int]:
    """(new height, new width): aspect ratio kept, each side between one tile and the canvas, the limiting side
    exactly at its target and the other floored (at least 1 pixel)."""
    target_w = min(max(width, tile_size), canvas_width)
    target_h = min(max(height, tile_size), canvas_height)
    scale_h, scale_w = target_h / height, target_w / width
    if scale_w < scale_h:
        return min(math.floor(height * scale_w) or 1, target_h), target_w
    return target_h, min(math.floor(width * scale_h) or 1, target_w)


def normalize(canvas: np.ndarray, cfg: ImageProcessorConfig) -> np.ndarray:
    """uint8 canvas [C, h, w] -> float32 [C, h, w]: x · rescale_factor (in float64, then rounded to float32),
    then (x − mean) / std in float32, HF's order and precisions."""
    x = canvas
    if cfg.do_rescale:
        x = (x.astype(np.float64) * cfg.rescale_factor).astype(np.float32)
    x = x.astype(np.float32)
    if cfg.do_normalize:
        mean = np.array(cfg.image_mean, dtype=np.float32)[:, None, None]  # [C, 1, 1]
        std = np.array(cfg.image_std, dtype=np.float32)[:, None, None]
        x = (x - mean) / std
    return x


def split_tiles(canvas: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """[C, rows·X, cols·X] -> [rows·cols, C, X, X], tiles in row-major order."""
    c, h, w = canvas.shape
    p = h // rows
    x = canvas.reshape(c, rows, p, cols, p)  # [C, rows, X, cols, X]
    x = x.transpose(1, 3, 0, 2, 4)  # [rows, cols, C, X, X]
    return np.ascontiguousarray(x.reshape(rows * cols, c, p, p))  # [rows·cols, C, X, X]


def image_tiles(image, cfg: ImageProcessorConfig) -> tuple[np.ndarray, tuple[int, int]]:
    """An RGB PIL image -> (tiles [n, C, X, X] float32, (rows, cols))."""
    if image.mode != "RGB":
        raise ValueError(f"image_tiles takes RGB images, got mode {image.mode}")  # callers convert first
    p = cfg.tile_size
    canvas_h, canvas_w = optimal_canvas(image.height, image.width, cfg.max_image_tiles, p)
    new_h, new_w = fit_to_canvas(image.height, image.width, canvas_h, canvas_w, p)
    resized = np.asarray(image.resize((new_w, new_h), resample=cfg.resample))  # [h, w, C] uint8
    canvas = np.zeros((3, canvas_h, canvas_w), dtype=np.uint8)  # [C, canvas h, canvas w], zero padding bottom and right
    canvas[:, :new_h, :new_w] = resized.transpose(2, 0, 1)  # [h, w, C] -> [C, h, w]
    rows, cols = canvas_h // p, canvas_w // p
    return split_tiles(normalize(canvas, cfg), rows, cols), (rows, cols)


def preprocess(images: list, cfg: ImageProcessorConfig) -> ImageBatch:
    """One prompt's PIL images -> ImageBatch. With do_convert_rgb, non-RGB images are converted as
    `refimpl.vision.image_io.to_rgb` does (transparency composited onto white)."""
    from refimpl.vision.image_io import to_rgb
    from refimpl.errors import ImageError

    if not images:
        raise ValueError("preprocess needs at least one image")
    a, p = cfg.max_image_tiles, cfg.tile_size
    arrangements = supported_aspect_ratios(a)
    pixel_values = np.zeros((len(images), a, 3, p, p), dtype=np.float32)  # [I, A, C, X, X]
    ids = np.zeros(len(images), dtype=np.int64)  # [I]
    mask = np.zeros((len(images), a), dtype=np.int64)  # [I, A]
    mask[:, 0] = 1  # HF marks the first slot of every image, even a padding one
    num_tiles = []
    for i, image in enumerate(images):
        if not cfg.do_convert_rgb and image.mode != "RGB":
            raise ImageError(f"image {i + 1} has mode {image.mode}, and preprocessor_config.json's "
                             f"do_convert_rgb is false; expected an RGB image")
        rgb = to_rgb(image, f"image {i + 1}") if cfg.do_convert_rgb else image
        tiles, arrangement = image_tiles(rgb, cfg)
        pixel_values[i, :len(tiles)] = tiles
        ids[i] = arrangements.index(arrangement) + 1
        mask[i, :len(tiles)] = 1
        num_tiles.append(len(tiles))
    return ImageBatch(pixel_values, ids, mask, num_tiles)
