"""Loading a checkpoint as users download it: a Hugging Face directory or a single GGUF file.

A directory holds config.json, model.safetensors or model.safetensors.index.json with its shards,
tokenizer.json, tokenizer_config.json (chat_template) or chat_template.jinja, and generation_config.json (eos).
Tensors come back as float32 NumPy arrays keyed by the checkpoint's names; shapes are checked against the config.
config.json's model_type picks the model family (refimpl.family), whose loader reads the directory.
"""
from __future__ import annotations

import json
import shutil
import stat
from pathlib import Path

import numpy as np

from refimpl.errors import CheckpointError, ConfigError
from refimpl.family import family_of_config_json
from refimpl.formats.gguf_loader import load_gguf
from refimpl.formats.jsonfile import read_config_json
from refimpl.formats.params import Checkpoint
from refimpl.formats.safe_open import check_path, open_regular, stat_path
from refimpl.formats.safetensors_io import SafetensorsFile, save_safetensors
from refimpl.formats.shards import weight_files
from refimpl.model.config import LlamaConfig
from refimpl.quant.apply import quantize_params


def load_checkpoint(path: str | Path, with_tokenizer: bool = True, quant=None, text_only: bool = False) -> Checkpoint:
    """Load a model directory or a .gguf file into float32 NumPy parameters (plus tokenizer and stop ids).

    quant (a refimpl.quant.schemes.QuantSpec, `--quant`): int8/int4 quantize the linear layers after loading;
    gguf keeps a GGUF file's Q8_0/Q4_0/Q4_1 blocks as they are stored. text_only: a Llama 3.2 Vision directory is
    refused from its config.json, before any weight is read."""
    ckpt = _load(Path(path), with_tokenizer, quant is not None and quant.format == "gguf",
                 quant is None or quant.lm_head, text_only)
    if quant is not None and quant.format != "gguf":
        ckpt.params = quantize_params(ckpt.params, ckpt.config, quant, source=path)
    return ckpt


def _load(path: Path, with_tokenizer: bool, keep_blocks: bool, lm_head_blocks: bool, text_only: bool) -> Checkpoint:
    path = check_path(path, "model path")
    st = stat_path(path, "expected a model directory or a .gguf file")
    if path.suffix == ".gguf" or (st is not None and stat.S_ISREG(st.st_mode) and _is_gguf(path)):
        return load_gguf(path, with_tokenizer, keep_blocks, lm_head_blocks)
    if keep_blocks:
        raise CheckpointError(f"{path}: --quant gguf keeps a GGUF file's quantized blocks; this is not a .gguf file "
                              "(use --quant int8 or int4 to quantize it)")
    if st is None:
        raise CheckpointError(f"{path}: no such file or directory (expected a model directory or a .gguf file)")
    if not stat.S_ISDIR(st.st_mode):
        raise CheckpointError(f"{path}: expected a model directory (with config.json) or a .gguf file")
    config = read_config_json(path / "config.json")
    family = family_of_config_json(config)
    if text_only and family.takes_images:
        raise ConfigError(f"{path / 'config.json'}: model_type is {config.get('model_type')!r} (Llama 3.2 Vision); "
                          "expected a text Llama model")
    return family.load_dir(path, with_tokenizer, config)


def _is_gguf(path: Path) -> bool:
    with open_regular(path) as f:
        return f.read(4) == b"GGUF"


def save_checkpoint(model_dir: str | Path, cfg: LlamaConfig, params: dict[str, np.ndarray],
                    dtype: str = "F32") -> Path:
    """Write config.json + model.safetensors in HF's layout (used for golden files, tests and benchmarks)."""
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(cfg.to_hf(), indent=2) + "\n")
    save_safetensors(model_dir / "model.safetensors", params, dtype=dtype, metadata={"format": "pt"})
    return model_dir


def weight_dtype(model_dir: Path) -> str:
    """The safetensors dtype (BF16, F16, F32) a checkpoint directory stores its weights in (its token embedding's:
    model.embed_tokens.weight, or a vision model's language_model one in either naming scheme)."""
    files = weight_files(model_dir)
    name = next(n for n in files if n.endswith("embed_tokens.weight"))
    path = files[name]
    return SafetensorsFile(path).tensors[name].dtype


def save_sharded(model_dir: str | Path, params: dict[str, np.ndarray], dtype: str, max_shard_bytes: int) -> list[Path]:
    """Write params as HF's sharded layout: model-0000i-of-0000n.safetensors (each at most max_shard_bytes unless a
    single tensor is larger) plus model.safetensors.index.json; one file without an index when it all fits."""
    model_dir = Path(model_dir)
    itemsize = 4 if dtype == "F32" else 2
    shards, size = [[]], 0
    for name, array in params.items():
        nbytes = array.size * itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    n = len(shards)
    files = [model_dir / ("model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors")
             for i in range(n)]
    weight_map = {}
    for names, path in zip(shards, files):
        save_safetensors(path, {name: params[name] for name in names}, dtype=dtype, metadata={"format": "pt"})
        weight_map.update({name: path.name for name in names})
    if n > 1:
        total = sum(params[name].size * itemsize for name in weight_map)
        (model_dir / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    return files


# the files beside a directory checkpoint's weights that a derived copy (quantized, merged) carries as they are
SIDE_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "chat_template.jinja", "preprocessor_config.json")


def write_side_files(ckpt: Checkpoint, out: Path, config: dict) -> None:
    """config.json (the given dict) and the rest of what transformers reads beside the weights: a directory
    checkpoint's own SIDE_FILES copied as they are; for a GGUF file, generation_config.json and, with a tokenizer,
    tokenizer.json and tokenizer_config.json (chat template included) written from what the file holds."""
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if Path(ckpt.path).is_dir():
        for name in SIDE_FILES:
            if (Path(ckpt.path) / name).is_file():
                shutil.copyfile(Path(ckpt.path) / name, out / name)
        return
    cfg, tok = ckpt.config, ckpt.tokenizer
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": cfg.bos_token_id,
                                                            "eos_token_id": list(ckpt.stop_ids)}, indent=2) + "\n")
    if tok is not None:
        tok.tok.save(str(out / "tokenizer.json"))
        tcfg = {"bos_token": tok.bos_token, "eos_token": tok.eos_token, "tokenizer_class": "PreTrainedTokenizerFast"}
        if tok.chat_template:
            tcfg["chat_template"] = tok.chat_template
        (out / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2) + "\n")
