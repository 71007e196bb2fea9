"""A Llama 3.2 text checkpoint directory: config.json, model.safetensors (or its shards), every tensor's name and
shape checked from the headers before any data is read; a checkpoint `llama32 quantize` wrote (its config.json
declares a quantization_config) loads its quantized records as they are.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterator

import numpy as np

from refimpl.formats.hf_dir import assemble
from refimpl.formats.params import Checkpoint, check_params, expected_shapes
from refimpl.formats.quant_checkpoint import declares_quantization, load_quantized_params
from refimpl.formats.shards import read_headers
from refimpl.model.config import LlamaConfig
from refimpl.progress import Progress


def iter_safetensors(model_dir: Path, cfg: LlamaConfig) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (name, float32 array) for every expected tensor, validating names and shapes first."""
    holder, shapes = read_headers(model_dir)
    extra = check_params(shapes, cfg, str(model_dir))
    if extra:
        print(f"warning: {model_dir}: ignoring {len(extra)} unknown tensor(s), e.g. {extra[0]!r}", file=sys.stderr)
    for name in expected_shapes(cfg):
        yield name, holder[name].load_weight(name)


def load_text_checkpoint(path: Path, with_tokenizer: bool, config: dict) -> Checkpoint:
    """Float32 parameters (or a quantized checkpoint's records); config: config.json's contents, already read."""
    if declares_quantization(config):
        cfg, params, _ = load_quantized_params(path, config, str(path / "config.json"))
        return assemble(path, cfg, params, with_tokenizer)
    cfg = LlamaConfig.from_hf(config, source=str(path / "config.json"))
    params = {}
    # 9 tensors a layer + embed + norm (+ lm_head): counted, not listed, so 10^12 claimed layers fail in
    # check_params instead of hanging here
    total = 9 * cfg.num_hidden_layers + 2 + (not cfg.tie_word_embeddings)
    with Progress(f"loading {path.name}", total) as bar:
        for name, array in iter_safetensors(path, cfg):
            params[name] = array
            bar.advance()
    return assemble(path, cfg, params, with_tokenizer)
