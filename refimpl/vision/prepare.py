"""From image files and a prompt to the vision model's inputs, as HF's MllamaProcessor prepares them."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from refimpl.errors import ConfigError
from refimpl.vision.image_io import load_image
from refimpl.vision.inputs import ImageInputs
from refimpl.vision.processor import ImageBatch, ImageProcessorConfig, preprocess
from refimpl.vision.prompt import IMAGE_TOKEN, build_vision_prompt, image_token_id


@dataclass
class VisionRequest:
    prompt_ids: list[int]  # [T]
    images: ImageInputs  # pixel values, aspect ratios and the [T, I, A] cross-attention mask
    batch: ImageBatch  # the processor's output (num_tiles for reports)


def processor_config(model_dir: Path, cfg) -> ImageProcessorConfig:
    """preprocessor_config.json, checked against the encoder it feeds (cfg: a MllamaConfig)."""
    proc = ImageProcessorConfig.from_dir(model_dir)
    where = Path(model_dir) / "preprocessor_config.json"
    vision = cfg.vision
    if proc.tile_size != vision.image_size:
        raise ConfigError(f"{where}: size is {proc.tile_size} pixels, but config.json's vision_config.image_size "
                          f"is {vision.image_size}; the tiles must match the encoder")
    if proc.max_image_tiles != vision.max_num_tiles:
        raise ConfigError(f"{where}: max_image_tiles is {proc.max_image_tiles}, but config.json's "
                          f"vision_config.max_num_tiles is {vision.max_num_tiles}")
    return proc


def checked_image_token(cfg, tokenizer) -> int:
    """The tokenizer's <|image|> id, which must be config.json's image_token_index (cfg: a MllamaConfig)."""
    image_id = image_token_id(tokenizer)
    if image_id != cfg.image_token_index:
        raise ConfigError(f"{tokenizer.source}: {IMAGE_TOKEN} is id {image_id}, but config.json's "
                          f"image_token_index is {cfg.image_token_index}")
    return image_id


def load_images(image_paths: list[Path], proc: ImageProcessorConfig) -> ImageBatch:
    """Read the images (EXIF orientation applied, RGB) and tile them as the processor does."""
    return preprocess([load_image(path) for path in image_paths], proc)


def image_inputs(cfg, batch: ImageBatch, cross_attention_mask) -> ImageInputs:
    """The processor's output and the prompt's [T, I, A] cross-attention mask -> the model's image inputs."""
    return ImageInputs.from_arrays(cfg.vision, batch.pixel_values, batch.aspect_ratio_ids, batch.aspect_ratio_mask,
                                   cross_attention_mask)


def prepare(model_dir: Path, cfg, tokenizer, prompt: str, image_paths: list[Path], chat: bool = False,
            system: str | None = None) -> VisionRequest:
    """Read the images (EXIF orientation applied, RGB), tile them, and build the prompt's ids and mask."""
    proc = processor_config(model_dir, cfg)
    checked_image_token(cfg, tokenizer)
    batch = load_images(image_paths, proc)
    vp = build_vision_prompt(tokenizer, prompt, batch.num_tiles, proc.max_image_tiles, chat=chat, system=system)
    return VisionRequest(vp.ids, image_inputs(cfg, batch, vp.cross_attention_mask), batch)
