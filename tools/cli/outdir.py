"""The rule every command that writes a directory follows for its --out: a new or empty directory, never files
written over or among someone else's unless asked (`finetune --overwrite`)."""
from __future__ import annotations

from pathlib import Path

from refimpl.errors import GenerationError


def describe(out: Path) -> str:
    """What an existing, non-empty directory looks like it holds."""
    if (out / "adapter_config.json").is_file():
        return "holds a PEFT adapter"
    if (out / "config.json").is_file():
        return "holds a model checkpoint"
    return "is not empty"


def check_out_dir(out: Path, allow: str | None = None, overwrite: bool = False) -> None:
    """Refuse an --out that is a file, or a non-empty directory unless `overwrite`; `allow` names the flag that
    would permit it (said in the message)."""
    out = Path(out)
    if not out.exists():
        return
    if not out.is_dir():
        raise GenerationError(f"--out {out}: exists and is not a directory; choose a new directory")
    if overwrite or not any(out.iterdir()):
        return
    hint = f"choose a new directory{f', or pass {allow} to write over it' if allow else ''}"
    raise GenerationError(f"--out {out}: exists and {describe(out)}; {hint}")
