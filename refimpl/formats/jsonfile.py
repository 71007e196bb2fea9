"""Reading the JSON files of a checkpoint (config, index, tokenizer config, adapter config, golden manifest)."""
from __future__ import annotations

import json
from pathlib import Path

from refimpl.errors import CheckpointError, ConfigError, quote
from refimpl.formats.safe_open import read_bytes, stat_path

MAX_JSON_BYTES = 256 * 1024 * 1024  # tokenizer files run to tens of MB; past this it is not a settings file


def no_duplicate_keys(pairs):
    """object_pairs_hook: a key given twice is ambiguous (json keeps the last silently), so refuse it."""
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise ValueError(f"duplicate key {quote(key)}")
        seen[key] = value
    return seen


def read_json_object(path: Path, what: str, error: type[Exception] = CheckpointError, hint: str = "") -> dict:
    """The file's JSON object; every failure is one `error` naming the file and `what` it should hold."""
    tail = f"; {hint}" if hint else ""
    if stat_path(path, what, error) is None:
        raise error(f"{path}: not found ({what}){tail}")
    raw = read_bytes(path, what, error, limit=MAX_JSON_BYTES)
    try:
        d = json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicate_keys)
    except UnicodeDecodeError as e:
        raise error(f"{path}: not valid JSON (not UTF-8: {e.reason} at byte {e.start}); "
                    f"expected {what}{tail}") from None
    except ValueError as e:  # JSONDecodeError, and a duplicate key
        raise error(f"{path}: not valid JSON ({e}); expected {what}{tail}") from None
    except RecursionError:
        raise error(f"{path}: JSON nested too deeply; expected {what}{tail}") from None
    if not isinstance(d, dict):
        raise error(f"{path}: expected a JSON object ({what}){tail}")
    return d


def read_config_json(path: Path) -> dict:
    """A model's config.json (the file's path) as a JSON object."""
    return read_json_object(Path(path), "a model directory needs config.json", ConfigError)
