"""The model families llama32 runs, in one table: Llama 3.2 text ("text") and Llama 3.2 Vision ("vision").

What the refimpl does differently per family is a field of its `Family`: the config class, loading a checkpoint
directory, the tensors a checkpoint holds, the engine, the activation names of a forward, the ids a prompt may
hold, which modules a PEFT adapter may adapt. `family_of(config)` picks the family of a parsed config,
`family_of_config_json(d)` that of config.json's contents (its model_type). The accel backend and the tools keep
their own per-family parts in tables keyed by `Family.name` (accel.family.ENGINES, accel.train.session.TRAINING).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from refimpl.formats.lora_text import text_lora_param, text_lora_targets
from refimpl.formats.lora_vision import vision_lora_param, vision_lora_targets
from refimpl.formats.params import expected_shapes
from refimpl.formats.text_checkpoint import load_text_checkpoint
from refimpl.formats.vision_checkpoint import expected_vision_shapes, load_vision_checkpoint
from refimpl.generate import RefEngine
from refimpl.generate_vision import VisionEngine
from refimpl.model.config import LlamaConfig
from refimpl.model.names import activation_names, vision_activation_names
from refimpl.model.vision_config import MllamaConfig


@dataclass(frozen=True)
class Family:
    """One model family's parts; `cfg` below is an instance of `config_class`."""

    name: str  # the key of every per-family table
    config_class: type
    model_type: str | None  # config.json's model_type that selects the family (None: any the others don't take)
    takes_images: bool
    load_dir: Callable  # (directory, with_tokenizer, config.json's dict) -> Checkpoint
    expected_shapes: Callable  # cfg -> {checkpoint name: shape}
    engine: type  # the refimpl engine: engine(ckpt)
    forward_names: Callable  # (cfg, has_images) -> the activation names of one forward, in order
    token_rows: Callable  # cfg -> ids a prompt may hold (the embedding's rows)
    decoder_prefix: str  # the text decoder's parameter names start with it (refimpl serves unmerged LoRA there only)
    lora_param: Callable  # (PEFT module name, how it came, cfg, path for errors) -> the parameter it adapts
    lora_targets: Callable  # (adapter config dict, cfg, path, BoundedMatcher) -> the module names PEFT adapts


def _text_names(cfg: LlamaConfig, has_images: bool) -> list[str]:
    return activation_names(cfg.num_hidden_layers)


def _vision_names(cfg: MllamaConfig, has_images: bool) -> list[str]:
    return vision_activation_names(cfg, encode_images=has_images, image_in_cache=has_images)


TEXT = Family("text", LlamaConfig, None, False, load_text_checkpoint, expected_shapes, RefEngine, _text_names,
              lambda cfg: cfg.vocab_size, "", text_lora_param, text_lora_targets)
VISION = Family("vision", MllamaConfig, "mllama", True, load_vision_checkpoint, expected_vision_shapes, VisionEngine,
                _vision_names, lambda cfg: cfg.text.embedding_rows, "language_model.", vision_lora_param,
                vision_lora_targets)
FAMILIES = (TEXT, VISION)


def family_of(cfg) -> Family:
    """The family of a parsed config: the one whose config class it is an instance of, else text (a LlamaConfig)."""
    return next((f for f in FAMILIES if f is not TEXT and isinstance(cfg, f.config_class)), TEXT)


def family_of_config_json(d: dict) -> Family:
    """The family config.json's contents describe, by their model_type."""
    model_type = d.get("model_type") if isinstance(d, dict) else None
    return next((f for f in FAMILIES if f.model_type is not None and f.model_type == model_type), TEXT)
