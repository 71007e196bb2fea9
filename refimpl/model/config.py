"""Model configuration: one frozen dataclass built from a Hugging Face `config.json`, plus named presets.

Field names are HF's, so a reader can put config.json beside this file and see each value land.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from refimpl.errors import ConfigError, quote
from refimpl.model.config_fields import LLAMA_FIELDS, ROPE_FIELDS, check_fields
from refimpl.formats.jsonfile import read_config_json


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3's frequency scaling ("rope_type": "llama3"); Llama 3.2 1B/3B use factor 32."""

    factor: float = 32.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int = 0  # 0: hidden_size // num_attention_heads (HF's default when config.json has none)
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    max_position_embeddings: int = 131072
    extra: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    def __post_init__(self):
        if self.head_dim == 0 and isinstance(self.num_attention_heads, int) and self.num_attention_heads > 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        self.validate()

    # ---- derived sizes ----
    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def gqa_group(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def validate(self, source: str = "config") -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 < value < 2 ** 63:
                raise ConfigError(f"{source}: {name} must be a positive integer, got {quote(value)}"
                                  f"{' (at most 2^63 - 1)' if isinstance(value, int) and value > 0 else ''}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"{source}: num_key_value_heads ({self.num_key_value_heads}) must divide "
                              f"num_attention_heads ({self.num_attention_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"{source}: head_dim must be even for RoPE, got {self.head_dim}")
        if not (self.rms_norm_eps > 0 and math.isfinite(self.rms_norm_eps)):
            raise ConfigError(f"{source}: rms_norm_eps must be a positive number, got {self.rms_norm_eps!r}")
        if not (self.rope_theta > 0 and math.isfinite(self.rope_theta)):
            raise ConfigError(f"{source}: rope_theta must be a positive number, got {self.rope_theta!r}")

    def fingerprint(self) -> str:
        """A short hash of every field that changes the computation (golden manifests record it)."""
        d = dataclasses.asdict(self)
        d.pop("extra", None)
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    # ---- HF config.json ----
    @classmethod
    def from_hf(cls, d: dict, source: str = "config.json") -> "LlamaConfig":
        if not isinstance(d, dict):
            raise ConfigError(f"{source}: expected a JSON object")
        model_type = d.get("model_type", "llama")
        if model_type != "llama":
            raise ConfigError(f"{source}: model_type {quote(model_type)} is not supported (expected 'llama')")
        check_fields(d, LLAMA_FIELDS, source)

        def num(name, kind=int, default=None):
            if name not in d or d[name] is None:
                if default is None:
                    raise ConfigError(f"{source}: missing required field {name!r}")
                return default
            value = d[name]
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            if kind is int and isinstance(value, float):
                ok = value.is_integer()
            elif kind is float and isinstance(value, int):
                ok = ok and abs(value) < 2 ** 1000  # float(10**400) overflows
            if not ok:
                raise ConfigError(f"{source}: field {name!r} must be a{'n integer' if kind is int else ' number'}, "
                                  f"got {quote(value)}")
            return kind(value)

        hidden = num("hidden_size")
        heads = num("num_attention_heads")
        if "head_dim" in d and d["head_dim"] is not None:
            head_dim = num("head_dim")
        else:
            if heads and hidden % heads:
                raise ConfigError(f"{source}: num_attention_heads ({heads}) must divide hidden_size ({hidden}) "
                                  f"when no head_dim is given")
            head_dim = 0
        # transformers >= 5 writes rope settings as "rope_parameters" (with rope_theta inside it).
        rope = d.get("rope_scaling") or d.get("rope_parameters") or {}
        if not isinstance(rope, dict):
            raise ConfigError(f"{source}: rope_scaling must be an object or null, got {quote(rope)}")
        check_fields(rope, ROPE_FIELDS, source, prefix="rope_scaling.")
        rope_theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type == "llama3":
            def rnum(key):
                if not isinstance(rope.get(key), (int, float)) or isinstance(rope.get(key), bool):
                    raise ConfigError(f"{source}: rope_scaling.{key} must be a number, got {quote(rope.get(key))}")
                return rope[key]
            scaling = RopeScaling(float(rnum("factor")), float(rnum("low_freq_factor")),
                                  float(rnum("high_freq_factor")), int(rnum("original_max_position_embeddings")))
            if not (all(math.isfinite(x) for x in (scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor))
                    and scaling.factor > 0 and 0 < scaling.low_freq_factor < scaling.high_freq_factor
                    and scaling.original_max_position_embeddings > 0):  # ops divide by each of these
                raise ConfigError(f"{source}: rope_scaling needs factor > 0, 0 < low_freq_factor < "
                                  f"high_freq_factor and original_max_position_embeddings > 0, got {quote(rope)}")
        elif rope_type == "default":
            scaling = None
        else:
            raise ConfigError(f"{source}: rope_scaling type {quote(rope_type)} is not supported "
                              f"(expected 'llama3' or none)")
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        if not all(isinstance(e, int) and not isinstance(e, bool) and e >= 0 for e in eos_ids):
            raise ConfigError(f"{source}: eos_token_id must be an integer or a list of integers (token ids >= 0), "
                              f"got {quote(eos)}")
        bos = d.get("bos_token_id")
        if bos is not None and (not isinstance(bos, int) or isinstance(bos, bool) or bos < 0):
            raise ConfigError(f"{source}: bos_token_id must be a token id (an integer >= 0), got {quote(bos)}")
        if not isinstance(rope_theta, (int, float)) or isinstance(rope_theta, bool):
            raise ConfigError(f"{source}: rope_theta must be a number, got {quote(rope_theta)}")
        fields = dict(
            vocab_size=num("vocab_size"), hidden_size=hidden, intermediate_size=num("intermediate_size"),
            num_hidden_layers=num("num_hidden_layers"), num_attention_heads=heads,
            num_key_value_heads=num("num_key_value_heads", default=heads), head_dim=head_dim,
            rope_theta=float(rope_theta), rope_scaling=scaling,
            rms_norm_eps=num("rms_norm_eps", float, 1e-6),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=bos, eos_token_ids=eos_ids,
            max_position_embeddings=num("max_position_embeddings", default=131072),
            extra={k: v for k, v in d.items() if k in ("torch_dtype", "dtype", "architectures", "_name_or_path")},
        )
        try:
            return cls(**fields)
        except ConfigError as e:  # __post_init__ validates without knowing the file: name it here
            raise ConfigError(f"{source}: {str(e).removeprefix('config: ')}") from None

    @classmethod
    def from_file(cls, path: str | Path) -> "LlamaConfig":
        d = read_config_json(Path(path))
        return cls.from_hf(d, source=str(path))

    def to_hf(self) -> dict:
        d = {
            "model_type": "llama", "architectures": ["LlamaForCausalLM"],
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "rope_theta": self.rope_theta, "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings, "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        }
        if self.rope_scaling is not None:
            d["rope_scaling"] = {"rope_type": "llama3", **dataclasses.asdict(self.rope_scaling)}
        if self.bos_token_id is not None:
            d["bos_token_id"] = self.bos_token_id
        if self.eos_token_ids:
            d["eos_token_id"] = list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else self.eos_token_ids[0]
        return d


_LLAMA3_ROPE = RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                           original_max_position_embeddings=8192)
_LLAMA3_COMMON = dict(vocab_size=128256, intermediate_size=8192, num_key_value_heads=8, rope_theta=500000.0,
                      rope_scaling=_LLAMA3_ROPE, rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=128000,
                      eos_token_ids=(128001, 128008, 128009), max_position_embeddings=131072)

PRESETS: dict[str, LlamaConfig] = {
    "llama-3.2-1b": LlamaConfig(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, head_dim=64,
                                **_LLAMA3_COMMON),
    "llama-3.2-3b": LlamaConfig(hidden_size=3072, num_hidden_layers=28, num_attention_heads=24, head_dim=128,
                                **_LLAMA3_COMMON),
    # The real model the CLI downloads by default; also the shape of the CPU benchmark.
    "smollm2-135m": LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0,
                                rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,),
                                max_position_embeddings=8192),
}
