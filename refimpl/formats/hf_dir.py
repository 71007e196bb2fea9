"""A Hugging Face checkpoint directory's Checkpoint, whatever model it holds: the loaded parameters and config with
the files beside them (tokenizer.json and its config, generation_config.json's stop ids).
"""
from __future__ import annotations

from pathlib import Path

from refimpl.errors import CheckpointError
from refimpl.formats.jsonfile import read_json_object
from refimpl.formats.params import Checkpoint
from refimpl.formats.safe_open import stat_path
from refimpl.model.config import LlamaConfig
from refimpl.text.tokenizer import TextTokenizer


def assemble(path: Path, cfg, params: dict, with_tokenizer: bool) -> Checkpoint:
    """A directory's Checkpoint from its config (a LlamaConfig or MllamaConfig) and loaded parameters: the
    tokenizer (with_tokenizer) and the stop ids read beside them."""
    tokenizer = TextTokenizer.from_dir(path, cfg) if with_tokenizer else None
    return Checkpoint(path, cfg, params, tokenizer, stop_ids(path, cfg, tokenizer))


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
