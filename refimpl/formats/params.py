"""A Llama checkpoint's parameters: the tensor names and shapes a config implies, and the loaded record.

Shared by every format reader (HF directories, GGUF), so none of them needs another.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from refimpl.errors import CheckpointError
from refimpl.model.config import LlamaConfig


def decoder_layer_shapes(p: str, cfg: LlamaConfig, attn: str = "self_attn.") -> dict[str, tuple[int, ...]]:
    """One decoder layer's norms, attention projections (under `attn`: self_attn. or Mllama's cross_attn.) and MLP,
    named below the layer's prefix `p` (model.layers.3.)."""
    D, F = cfg.hidden_size, cfg.intermediate_size
    return {
        p + "input_layernorm.weight": (D,),
        p + attn + "q_proj.weight": (cfg.q_size, D),
        p + attn + "k_proj.weight": (cfg.kv_size, D),
        p + attn + "v_proj.weight": (cfg.kv_size, D),
        p + attn + "o_proj.weight": (D, cfg.q_size),
        p + "post_attention_layernorm.weight": (D,),
        p + "mlp.gate_proj.weight": (F, D),
        p + "mlp.up_proj.weight": (F, D),
        p + "mlp.down_proj.weight": (D, F),
    }


def expected_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a Llama checkpoint must hold, in the checkpoint's own names."""
    D, V = cfg.hidden_size, cfg.vocab_size
    shapes = {"model.embed_tokens.weight": (V, D)}
    for i in range(cfg.num_hidden_layers):
        shapes.update(decoder_layer_shapes(f"model.layers.{i}.", cfg))
    shapes["model.norm.weight"] = (D,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, D)
    return shapes


def check_params(names_shapes: dict[str, tuple], cfg: LlamaConfig, source: str) -> list[str]:
    """Raise on missing tensors or wrong shapes; return the names of unknown extra tensors (to warn about)."""
    if cfg.num_hidden_layers > len(names_shapes):  # a config claiming 10^12 layers: fail before listing them
        i = next(i for i in range(len(names_shapes) + 1)
                 if f"model.layers.{i}.input_layernorm.weight" not in names_shapes)
        raise CheckpointError(f"{source}: missing tensor 'model.layers.{i}.input_layernorm.weight' and more "
                              f"(config.json describes {cfg.num_hidden_layers} layers)")
    return check_shapes(names_shapes, expected_shapes(cfg), source, f"{cfg.num_hidden_layers} layers")


def check_shapes(names_shapes: dict[str, tuple], want: dict[str, tuple], source: str, layers: str) -> list[str]:
    """Raise on a tensor of `want` missing or shaped otherwise; return the unknown extra names.
    `layers` says what config.json describes ("16 layers"), for the message."""
    missing = [n for n in want if n not in names_shapes]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise CheckpointError(f"{source}: missing tensor {missing[0]!r}{more} (config.json describes {layers})")
    for n, shape in want.items():
        if tuple(names_shapes[n]) != shape:
            raise CheckpointError(f"{source}: tensor {n!r} has shape {list(names_shapes[n])}, but config.json "
                                  f"implies {list(shape)}")
    return [n for n in names_shapes if n not in want]


@dataclass
class Checkpoint:
    path: Path
    config: LlamaConfig
    params: dict[str, np.ndarray] = field(repr=False)
    tokenizer: object | None = field(default=None, repr=False)  # refimpl.text.tokenizer.TextTokenizer
    stop_ids: tuple[int, ...] = ()


def random_params(cfg: LlamaConfig, seed: int = 0, std: float = 0.02) -> dict[str, np.ndarray]:
    """Random float32 weights at the config's shapes (norm weights near 1), for tests and benchmarks."""
    rng = np.random.default_rng(seed)
    params = {}
    for name, shape in expected_shapes(cfg).items():
        if name.endswith("norm.weight"):
            params[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            params[name] = (std * rng.standard_normal(shape, dtype=np.float32))
    return params
