"""Llama 3.2 Vision (HF `model_type: mllama`) configuration: the text decoder, the vision encoder, the image token.

config.json nests `text_config` and `vision_config`; a missing field takes HF's default (those of
`MllamaTextConfig` / `MllamaVisionConfig`, i.e. the 11B model), as `from_pretrained` does.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from refimpl.errors import ConfigError, quote
from refimpl.model.config_fields import MLLAMA_FIELDS, MLLAMA_TEXT_FIELDS, MLLAMA_VISION_FIELDS, check_fields
from refimpl.formats.jsonfile import read_config_json
from refimpl.model.config import LlamaConfig

EXTRA_EMBEDDING_ROWS = 8  # embed_tokens has vocab_size + 8 rows: <|image|> (vocab_size in the released checkpoints)
# and 7 reserved ids

_TEXT_DEFAULTS = dict(vocab_size=128256, hidden_size=4096, num_hidden_layers=40, num_attention_heads=32,
                      num_key_value_heads=8, intermediate_size=14336, rope_theta=500000.0, rms_norm_eps=1e-5,
                      max_position_embeddings=131072, tie_word_embeddings=False, bos_token_id=128000,
                      eos_token_id=128001, cross_attention_layers=[3, 8, 13, 18, 23, 28, 33, 38])
_DEFAULT_ASPECT_RATIOS = ((1, 1), (1, 2), (1, 3), (1, 4), (2, 1), (2, 2), (3, 1), (4, 1))


@dataclass(frozen=True)
class MllamaTextConfig(LlamaConfig):
    """A Llama decoder whose layers at `cross_attention_layers` attend to the image instead of the text.

    head_dim is always hidden_size // num_attention_heads (HF's Mllama ignores a head_dim field)."""

    cross_attention_layers: tuple[int, ...] = ()

    @property
    def embedding_rows(self) -> int:
        return self.vocab_size + EXTRA_EMBEDDING_ROWS

    def validate(self, source: str = "config") -> None:
        super().validate(source)
        layers = self.cross_attention_layers
        if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < self.num_hidden_layers
                   for i in layers) or len(set(layers)) != len(layers):
            raise ConfigError(f"{source}: cross_attention_layers must be distinct layer indices in "
                              f"[0, {self.num_hidden_layers}), got {list(layers)}")


@dataclass(frozen=True)
class VisionConfig:
    """HF's MllamaVisionConfig. Letters (refimpl.model.interface): U hidden, M intermediate, O output dim."""

    hidden_size: int = 1280
    intermediate_size: int = 5120
    num_hidden_layers: int = 32
    num_global_layers: int = 8
    attention_heads: int = 16
    num_channels: int = 3
    image_size: int = 448
    patch_size: int = 14
    norm_eps: float = 1e-5
    max_num_tiles: int = 4
    vision_output_dim: int = 7680
    intermediate_layers_indices: tuple[int, ...] = (3, 7, 15, 23, 30)
    supported_aspect_ratios: tuple[tuple[int, int], ...] = _DEFAULT_ASPECT_RATIOS

    def __post_init__(self):
        self.validate()

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.attention_heads

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def tokens_per_tile(self) -> int:
        """P: the tile's patches plus the class token (1601 for 448-pixel tiles of 14-pixel patches)."""
        return self.patches_per_side ** 2 + 1

    @property
    def padded_tokens_per_tile(self) -> int:
        """Q: P rounded up to a multiple of 8 (HF and Meta pad the patch sequence so)."""
        return -(-self.tokens_per_tile // 8) * 8

    @property
    def max_aspect_ratio_id(self) -> int:
        return len(self.supported_aspect_ratios)  # ids are 1-based; 0 marks "no image"

    def validate(self, source: str = "config") -> None:
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_global_layers",
                     "attention_heads", "num_channels", "image_size", "patch_size", "max_num_tiles",
                     "vision_output_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{source}: vision_config.{name} must be a positive integer, got {value!r}")
        if self.hidden_size % self.attention_heads:
            raise ConfigError(f"{source}: vision_config.attention_heads ({self.attention_heads}) must divide "
                              f"hidden_size ({self.hidden_size})")
        if self.image_size % self.patch_size:
            raise ConfigError(f"{source}: vision_config.patch_size ({self.patch_size}) must divide image_size "
                              f"({self.image_size})")
        idx = self.intermediate_layers_indices
        if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < self.num_hidden_layers for i in idx):
            raise ConfigError(f"{source}: vision_config.intermediate_layers_indices must be layer indices in "
                              f"[0, {self.num_hidden_layers}), got {list(idx)}")
        want = self.hidden_size * (1 + len(idx))  # the final features plus one copy per intermediate layer
        if self.vision_output_dim != want:
            raise ConfigError(f"{source}: vision_config.vision_output_dim is {self.vision_output_dim}, but hidden_size "
                              f"× (1 + {len(idx)} intermediate layers) = {want}")
        if not self.supported_aspect_ratios or not all(
                len(r) == 2 and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in r)
                and r[0] * r[1] <= self.max_num_tiles for r in self.supported_aspect_ratios):
            raise ConfigError(f"{source}: vision_config.supported_aspect_ratios must be [rows, columns] pairs of "
                              f"positive integers with at most max_num_tiles ({self.max_num_tiles}) tiles, got "
                              f"{[list(r) for r in self.supported_aspect_ratios]}")
        if not self.norm_eps > 0:
            raise ConfigError(f"{source}: vision_config.norm_eps must be a positive number, got {self.norm_eps!r}")


@dataclass(frozen=True)
class MllamaConfig:
    text: MllamaTextConfig
    vision: VisionConfig
    image_token_index: int = 128256

    # The text-model sizes every tool asks a config for (the tokens, the context, the layer count).
    @property
    def vocab_size(self) -> int:
        return self.text.vocab_size

    @property
    def max_position_embeddings(self) -> int:
        return self.text.max_position_embeddings

    @property
    def num_hidden_layers(self) -> int:
        return self.text.num_hidden_layers

    @property
    def bos_token_id(self) -> int | None:
        return self.text.bos_token_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.text.eos_token_ids

    def fingerprint(self) -> str:
        d = {"text": self.text.fingerprint(), "vision": dataclasses.asdict(self.vision),
             "image_token_index": self.image_token_index}
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    @classmethod
    def from_hf(cls, d: dict, source: str = "config.json") -> "MllamaConfig":
        if not isinstance(d, dict) or d.get("model_type") != "mllama":
            raise ConfigError(f"{source}: expected a config with model_type 'mllama'")
        check_fields(d, MLLAMA_FIELDS, source)
        text, vision = d.get("text_config", {}), d.get("vision_config", {})
        for key, value in (("text_config", text), ("vision_config", vision)):
            if not isinstance(value, dict):
                raise ConfigError(f"{source}: {key} must be an object, got {quote(value)}")
        check_fields(text, MLLAMA_TEXT_FIELDS, source, prefix="text_config.")
        check_fields(vision, MLLAMA_VISION_FIELDS, source, prefix="vision_config.")
        image_token = d.get("image_token_index", d.get("image_token_id", 128256))
        if not isinstance(image_token, int) or isinstance(image_token, bool) or image_token < 0:
            raise ConfigError(f"{source}: image_token_index must be a non-negative integer, got {image_token!r}")
        cfg = cls(_text_from_hf(text, source), _vision_from_hf(vision, source), image_token)
        # as HF's MllamaForConditionalGeneration: the image token is a row of embed_tokens like any other (the
        # released checkpoints use the first extra row, vocab_size; a config may name an id of the vocabulary)
        if not image_token < cfg.text.embedding_rows:
            raise ConfigError(f"{source}: image_token_index {image_token} must be a row of the text embedding "
                              f"[0, {cfg.text.embedding_rows}) (vocab_size {cfg.text.vocab_size} + "
                              f"{EXTRA_EMBEDDING_ROWS} extra rows)")
        return cfg

    @classmethod
    def from_file(cls, path: str | Path) -> "MllamaConfig":
        d = read_config_json(Path(path))
        return cls.from_hf(d, source=str(path))

    def to_hf(self) -> dict:
        text = self.text.to_hf()
        text.pop("head_dim")
        text.update(model_type="mllama_text_model", cross_attention_layers=list(self.text.cross_attention_layers))
        text.pop("architectures")
        vision = dataclasses.asdict(self.vision)
        vision.update(model_type="mllama_vision_model", hidden_act="gelu",
                      intermediate_layers_indices=list(self.vision.intermediate_layers_indices),
                      supported_aspect_ratios=[list(r) for r in self.vision.supported_aspect_ratios])
        return {"model_type": "mllama", "architectures": ["MllamaForConditionalGeneration"],
                "image_token_index": self.image_token_index, "text_config": text, "vision_config": vision}


def _text_from_hf(d: dict, source: str) -> MllamaTextConfig:
    merged = {**_TEXT_DEFAULTS, **{k: v for k, v in d.items() if v is not None}}
    layers = merged.pop("cross_attention_layers")
    if not isinstance(layers, list):
        raise ConfigError(f"{source}: text_config.cross_attention_layers must be a list, got {layers!r}")
    merged.pop("head_dim", None)  # HF's Mllama derives it from hidden_size
    merged["model_type"] = "llama"
    try:
        base = LlamaConfig.from_hf(merged, source=f"{source}: text_config")
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(LlamaConfig)}
        fields["tie_word_embeddings"] = False  # lm_head has V rows, embed_tokens V + 8: HF never ties them
        return MllamaTextConfig(**fields, cross_attention_layers=tuple(layers))
    except ConfigError as e:
        raise ConfigError(str(e).replace("config: ", f"{source}: text_config: ", 1)) from None


def _vision_from_hf(d: dict, source: str) -> VisionConfig:
    fields = {}
    for f in dataclasses.fields(VisionConfig):
        if d.get(f.name) is None:
            continue
        value = d[f.name]
        if f.name == "intermediate_layers_indices":
            if not isinstance(value, list):
                raise ConfigError(f"{source}: vision_config.{f.name} must be a list, got {value!r}")
            value = tuple(value)
        elif f.name == "supported_aspect_ratios":
            if not isinstance(value, list) or not all(isinstance(r, list) for r in value):
                raise ConfigError(f"{source}: vision_config.{f.name} must be a list of [rows, columns], got "
                                  f"{value!r}")
            value = tuple(tuple(r) for r in value)
        elif f.name in ("image_size", "patch_size") and isinstance(value, list):
            if len(value) != 2 or value[0] != value[1]:
                raise ConfigError(f"{source}: vision_config.{f.name} must be square, got {value!r}")
            value = value[0]
        elif f.name == "norm_eps":
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise ConfigError(f"{source}: vision_config.norm_eps must be a number, got {value!r}")
            value = float(value)
        fields[f.name] = value
    try:
        return VisionConfig(**fields)
    except ConfigError as e:
        raise ConfigError(str(e).replace("config: ", f"{source}: ", 1)) from None
