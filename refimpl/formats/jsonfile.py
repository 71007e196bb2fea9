"""Reading the JSON files of a checkpoint (config, index, tokenizer config, adapter config, golden manifest)."""
from __future__ import annotations

import json
from pathlib import Path

from refimpl.errors import CheckpointError


def read_json_object(path: Path, what: str, error: type[Exception] = CheckpointError, hint: str = "") -> dict:
    """The file's JSON object; every failure is one `error` naming the file and `what` it should hold."""
    tail = f"; {hint}" if hint else ""
    try:
        d = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise error(f"{path}: not found ({what}){tail}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise error(f"{path}: not valid JSON ({e}); expected {what}{tail}") from None
    except RecursionError:
        raise error(f"{path}: JSON nested too deeply; expected {what}{tail}") from None
    except OSError as e:  # a directory in its place, permission denied
        raise error(f"{path}: cannot read ({e.strerror or e}){tail}") from None
    if not isinstance(d, dict):
        raise error(f"{path}: expected a JSON object ({what}){tail}")
    return d
