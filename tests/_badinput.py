"""Shared pieces of the bad-input tests: a tiny valid model directory and a CLI runner that checks the error contract.

The contract (issue 8): bad input ends in exactly one line `error: ...` on stderr naming the file or argument, exit
status 2, and no Python traceback unless `--debug` was given.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
from click.testing import CliRunner

from refimpl.formats.checkpoint import save_checkpoint

from refimpl.formats.params import random_params
from refimpl.model.config import LlamaConfig

WORDS = [f"w{i}" for i in range(60)]  # tokenizer vocabulary: ids 0..59 are words, then the specials
SPECIALS = ["<unk>", "<s>", "</s>"]


def tiny_config(**overrides) -> LlamaConfig:
    base = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                bos_token_id=61, eos_token_ids=(62,), max_position_embeddings=64)
    base.update(overrides)
    return LlamaConfig(**base)


def write_tokenizer(model_dir: Path, words=WORDS) -> None:
    """A word-level tokenizer: 'w3 w7' -> [3, 7]; specials follow the words."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(list(words) + SPECIALS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(model_dir / "tokenizer.json"))


def make_model(model_dir: Path, cfg: LlamaConfig | None = None, params: dict | None = None,
               tokenizer: bool = True) -> Path:
    cfg = cfg or tiny_config()
    save_checkpoint(model_dir, cfg, params if params is not None else random_params(cfg, seed=0))
    if tokenizer:
        write_tokenizer(model_dir)
    return model_dir


def edit_config(model_dir: Path, **changes) -> None:
    """Rewrite config.json with fields changed (None deletes the field)."""
    path = model_dir / "config.json"
    d = json.loads(path.read_text())
    for k, v in changes.items():
        if v is None:
            d.pop(k, None)
        else:
            d[k] = v
    path.write_text(json.dumps(d))


# ---- safetensors surgery ----
def read_safetensors(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_raw_safetensors(path: Path, header: bytes | dict, data: bytes, header_len: int | None = None) -> None:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if header_len is None else header_len) + raw + data)


# ---- the CLI contract ----
def run_cli(args: list[str]):
    from tools.cli import main
    return CliRunner().invoke(main, [str(a) for a in args])


def generate_args(model_dir, *extra, prompt="w1 w2 w3") -> list[str]:
    return ["generate", prompt, "--model", str(model_dir), "--backend", "refimpl", "--max-new-tokens", "2",
            *map(str, extra)]


def assert_clean_error(result, *substrings: str) -> str:
    """Exit 2, one `error:` line on stderr containing every substring, no traceback. Returns the message."""
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert "Traceback" not in result.output
    lines = [ln for ln in result.stderr.splitlines() if not ln.startswith("warning:")]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for s in substrings:
        assert s in lines[0], (s, lines[0])
    return lines[0]


def first_nonfinite_name(steps) -> str | None:
    """The test's own scan of a forward generator for the first activation holding NaN/Inf."""
    for name, value in steps:
        if not np.all(np.isfinite(value)):
            return name
    return None
