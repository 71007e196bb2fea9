"""Llama 3.2 Vision checkpoints: the tensors an MllamaConfig implies, both key-name schemes, validated loading.

The Hub's files name tensors `language_model.model.*`, `language_model.lm_head.weight`, `vision_model.*` and
`multi_modal_projector.*`; newer transformers versions write `model.language_model.*`, `model.vision_model.*`,
`model.multi_modal_projector.*` and `lm_head.weight`. Both load; parameters come back in the Hub's names.
Every name and shape is checked from the safetensors headers before any tensor data is read.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from refimpl.errors import CheckpointError
from refimpl.formats.hf_dir import assemble
from refimpl.formats.shards import read_headers
from refimpl.formats.params import Checkpoint, check_shapes, decoder_layer_shapes
from refimpl.model.vision_config import MllamaConfig
from refimpl.progress import Progress

# newer transformers prefix -> the Hub's prefix
_RENAMES = (("model.language_model.", "language_model.model."), ("model.vision_model.", "vision_model."),
            ("model.multi_modal_projector.", "multi_modal_projector."), ("lm_head.", "language_model.lm_head."))


def hub_name(name: str) -> str:
    """A tensor name in the Hub's scheme, whichever scheme it was written in."""
    for new, hub in _RENAMES:
        if name.startswith(new):
            return hub + name[len(new):]
    return name


def transformers_name(name: str) -> str:
    """A Hub-scheme name in the scheme transformers 5 writes and names its modules by (PEFT's adapter keys)."""
    for new, hub in _RENAMES:
        if name.startswith(hub):
            return new + name[len(hub):]
    return name


def _vision_layer_shapes(prefix: str, U: int, M: int, gated: bool) -> dict:
    shapes = {prefix + "self_attn." + m + "_proj.weight": (U, U) for m in "qkvo"}
    shapes.update({prefix + "mlp.fc1.weight": (M, U), prefix + "mlp.fc1.bias": (M,),
                   prefix + "mlp.fc2.weight": (U, M), prefix + "mlp.fc2.bias": (U,)})
    for norm in ("input_layernorm", "post_attention_layernorm"):
        shapes.update({f"{prefix}{norm}.weight": (U,), f"{prefix}{norm}.bias": (U,)})
    if gated:
        shapes.update({prefix + "gate_attn": (1,), prefix + "gate_ffn": (1,)})
    return shapes


def tower_shapes(cfg: MllamaConfig) -> dict[str, tuple[int, ...]]:
    v = cfg.vision
    U, M, A, P, R = v.hidden_size, v.intermediate_size, v.max_num_tiles, v.tokens_per_tile, v.max_aspect_ratio_id
    pre = "vision_model."
    shapes = {
        pre + "patch_embedding.weight": (U, v.num_channels, v.patch_size, v.patch_size),
        pre + "class_embedding": (U,),
        pre + "gated_positional_embedding.embedding": (P, U),
        pre + "gated_positional_embedding.gate": (1,),
        pre + "gated_positional_embedding.tile_embedding.weight": (R + 1, A * P * U),
    }
    for which in ("pre_tile_positional_embedding.", "post_tile_positional_embedding."):
        shapes.update({pre + which + "embedding.weight": (R + 1, A * U), pre + which + "gate": (1,)})
    for norm in ("layernorm_pre", "layernorm_post"):
        shapes.update({f"{pre}{norm}.weight": (U,), f"{pre}{norm}.bias": (U,)})
    for i in range(v.num_hidden_layers):
        shapes.update(_vision_layer_shapes(f"{pre}transformer.layers.{i}.", U, M, gated=False))
    for i in range(v.num_global_layers):
        shapes.update(_vision_layer_shapes(f"{pre}global_transformer.layers.{i}.", U, M, gated=True))
    shapes.update({"multi_modal_projector.weight": (cfg.text.hidden_size, v.vision_output_dim),
                   "multi_modal_projector.bias": (cfg.text.hidden_size,)})
    return shapes


def decoder_shapes(cfg: MllamaConfig) -> dict[str, tuple[int, ...]]:
    t = cfg.text
    D, E = t.hidden_size, t.head_dim
    shapes = {"language_model.model.embed_tokens.weight": (t.embedding_rows, D)}
    for i in range(t.num_hidden_layers):
        p = f"language_model.model.layers.{i}."
        attn = "cross_attn." if i in t.cross_attention_layers else "self_attn."
        shapes.update(decoder_layer_shapes(p, t, attn))
        if attn == "cross_attn.":
            shapes.update({p + "cross_attn.q_norm.weight": (E,), p + "cross_attn.k_norm.weight": (E,),
                           p + "cross_attn_attn_gate": (1,), p + "cross_attn_mlp_gate": (1,)})
    shapes.update({"language_model.model.norm.weight": (D,), "language_model.lm_head.weight": (t.vocab_size, D)})
    return shapes


def expected_vision_shapes(cfg: MllamaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a Llama 3.2 Vision checkpoint must hold, in the Hub's names."""
    return {**tower_shapes(cfg), **decoder_shapes(cfg)}


def check_vision_dir(model_dir: str | Path, config: dict | None = None) -> tuple[MllamaConfig, dict]:
    """Validate config.json (`config`: its contents, already read) and every tensor's name and shape from the
    headers alone (no tensor data is read).

    Returns (config, {hub name: (SafetensorsFile, name in the file)})."""
    model_dir = Path(model_dir)
    cfg = (MllamaConfig.from_file(model_dir / "config.json") if config is None
           else MllamaConfig.from_hf(config, source=str(model_dir / "config.json")))
    files, shapes = read_headers(model_dir)
    layers_claimed = cfg.text.num_hidden_layers + cfg.vision.num_hidden_layers + cfg.vision.num_global_layers
    if layers_claimed > len(shapes):  # a config claiming 10^12 layers: fail before listing their tensors
        raise CheckpointError(f"{model_dir}: config.json describes {layers_claimed} layers, but the checkpoint "
                              f"holds only {len(shapes)} tensors")
    located, hub_shapes = {}, {}
    for name, shape in shapes.items():
        hub = hub_name(name)
        if hub in located:
            raise CheckpointError(f"{model_dir}: tensor {hub!r} appears twice (as {located[hub][1]!r} and "
                                  f"{name!r}); the checkpoint mixes two key-name schemes")
        located[hub], hub_shapes[hub] = (files[name], name), shape
    layers = f"{cfg.text.num_hidden_layers} text and {cfg.vision.num_hidden_layers}+" \
             f"{cfg.vision.num_global_layers} vision layers"
    extra = check_shapes(hub_shapes, expected_vision_shapes(cfg), str(model_dir), layers)
    if extra:
        print(f"warning: {model_dir}: ignoring {len(extra)} unknown tensor(s), e.g. {extra[0]!r}", file=sys.stderr)
    return cfg, located


def load_vision_checkpoint(model_dir: str | Path, with_tokenizer: bool = True,
                           config: dict | None = None) -> Checkpoint:
    """Float32 parameters in the Hub's names (fp32 tensors memory-mapped, bf16/fp16 widened one at a time);
    config: config.json's contents where the caller has read them."""
    model_dir = Path(model_dir)
    cfg, located = check_vision_dir(model_dir, config)
    want = expected_vision_shapes(cfg)
    params: dict[str, np.ndarray] = {}
    with Progress(f"loading {model_dir.name}", len(want)) as bar:
        for hub in want:
            file, name = located[hub]
            params[hub] = file.load_weight(name)
            bar.advance()
    return assemble(model_dir, cfg, params, with_tokenizer)

