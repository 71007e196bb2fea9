"""Loading a checkpoint as users download it: a Hugging Face directory or a single GGUF file.

A directory holds config.json, model.safetensors or model.safetensors.index.json with its shards,
tokenizer.json, tokenizer_config.json (chat_template) or chat_template.jinja, and generation_config.json (eos).
Tensors come back as float32 NumPy arrays keyed by the checkpoint's names; shapes are checked against the config.
"""
from __future__ import annotations

import json
import stat
import sys
from pathlib import Path
from typing import Iterator

import numpy as np

from refimpl.model.config import LlamaConfig
from refimpl.model.mllama_config import is_mllama_config
from refimpl.errors import CheckpointError, ConfigError
from refimpl.formats.jsonfile import read_json_object
from refimpl.progress import Progress
from refimpl.formats.gguf_loader import load_gguf
from refimpl.formats.params import Checkpoint, check_params, expected_shapes
from refimpl.formats.safe_open import check_path, open_regular, stat_path
from refimpl.formats.safetensors_io import SafetensorsFile, save_safetensors
from refimpl.formats.shards import open_shards


def read_headers(model_dir: Path) -> tuple[dict[str, SafetensorsFile], dict[str, tuple[int, ...]]]:
    """({tensor name: the opened file holding it}, {tensor name: shape}) from the headers alone."""
    where, files = open_shards(model_dir)
    holder = {name: files[path] for name, path in where.items()}
    return holder, {name: st.tensors[name].shape for name, st in holder.items()}


def iter_safetensors(model_dir: Path, cfg: LlamaConfig) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (name, float32 array) for every expected tensor, validating names and shapes first."""
    holder, shapes = read_headers(model_dir)
    extra = check_params(shapes, cfg, str(model_dir))
    if extra:
        print(f"warning: {model_dir}: ignoring {len(extra)} unknown tensor(s), e.g. {extra[0]!r}", file=sys.stderr)
    for name in expected_shapes(cfg):
        yield name, holder[name].load_weight(name)


def load_checkpoint(path: str | Path, with_tokenizer: bool = True) -> Checkpoint:
    """Load a model directory or a .gguf file into float32 NumPy parameters (plus tokenizer and stop ids)."""
    path = check_path(path, "model path")
    st = stat_path(path, "expected a model directory or a .gguf file")
    if path.suffix == ".gguf" or (st is not None and stat.S_ISREG(st.st_mode) and _is_gguf(path)):
        return load_gguf(path, with_tokenizer=with_tokenizer)
    if st is None:
        raise CheckpointError(f"{path}: no such file or directory (expected a model directory or a .gguf file)")
    if not stat.S_ISDIR(st.st_mode):
        raise CheckpointError(f"{path}: expected a model directory (with config.json) or a .gguf file")
    if is_mllama_config(read_json_object(path / "config.json", "a model directory needs config.json", ConfigError)):
        from refimpl.formats.mllama_checkpoint import load_mllama_checkpoint
        return load_mllama_checkpoint(path, with_tokenizer=with_tokenizer)
    cfg = LlamaConfig.from_file(path / "config.json")
    params = {}
    # 9 tensors a layer + embed + norm (+ lm_head): counted, not listed, so 10^12 claimed layers fail in
    # check_params instead of hanging here
    total = 9 * cfg.num_hidden_layers + 2 + (not cfg.tie_word_embeddings)
    with Progress(f"loading {path.name}", total) as bar:
        for name, array in iter_safetensors(path, cfg):
            params[name] = array
            bar.advance()
    tokenizer = None
    if with_tokenizer:
        from refimpl.text.tokenizer import TextTokenizer
        tokenizer = TextTokenizer.from_dir(path, cfg)
    return Checkpoint(path, cfg, params, tokenizer, stop_ids(path, cfg, tokenizer))


def _is_gguf(path: Path) -> bool:
    with open_regular(path) as f:
        return f.read(4) == b"GGUF"


def stop_ids(model_dir: Path, cfg: LlamaConfig, tokenizer=None) -> tuple[int, ...]:
    """Every eos id: generation_config.json's list (e.g. <|eot_id|>, <|eom_id|>), config.json's, the tokenizer's."""
    ids = list(cfg.eos_token_ids)
    gen = model_dir / "generation_config.json"
    if stat_path(gen) is not None:
        eos = read_json_object(gen, "generation settings").get("eos_token_id")
        extra = eos if isinstance(eos, list) else [eos] if eos is not None else []
        if not all(isinstance(e, int) and not isinstance(e, bool) for e in extra):
            raise CheckpointError(f"{gen}: eos_token_id must be an integer or a list of integers, got {eos!r}")
        ids += extra
    if tokenizer is not None and tokenizer.eos_id is not None:
        ids.append(tokenizer.eos_id)
    return tuple(dict.fromkeys(ids))


def save_checkpoint(model_dir: str | Path, cfg: LlamaConfig, params: dict[str, np.ndarray],
                    dtype: str = "F32") -> Path:
    """Write config.json + model.safetensors in HF's layout (used for golden files, tests and benchmarks)."""
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(cfg.to_hf(), indent=2) + "\n")
    save_safetensors(model_dir / "model.safetensors", params, dtype=dtype, metadata={"format": "pt"})
    return model_dir
