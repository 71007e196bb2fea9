"""Scripted `llama32 step` (--commands or stdin): commands split on ';' and newlines, each echoed after the prompt so
a transcript reads like the terminal, then run by the StepSession."""
from __future__ import annotations

import re
from typing import Iterable

from tools.debug.stepper import StepSession


def split_commands(text: str) -> list[str]:
    return [c.strip() for c in re.split(r"[;\n]", text) if c.strip()]


def run_script(session: StepSession, commands: Iterable[str], echo: bool = True) -> None:
    """Scripted mode: echo each command after the prompt (a transcript reads like the terminal) and run it
    (the ones that reported an error are in session.failed)."""
    for cmd in commands:
        if echo:
            session.out(f"(llama32) {cmd}")
        if not session.run(cmd):
            return

