"""Errors that mean "your input is wrong", as opposed to a bug in llama32.

The CLI catches `Llama32Error` and prints `error: <message>` as one line (exit 2); anything else is a bug and
keeps its traceback. Messages name the file, field or argument and say what was expected.

Messages quote values that come from the user's files (tensor names, config values, paths), which can be a
100,000 characters long or hold newlines: `quote()` renders one value short and escaped, and every
`Llama32Error` message passes through `one_line()`, so whatever was forgotten stays one short line.
"""
from __future__ import annotations

import os
import re

MAX_VALUE_CHARS = 80  # one quoted value
MAX_LINE_CHARS = 300  # the whole `error: ...` line
MAX_RUN_CHARS = 160  # an unquoted run without spaces: room for a long path, not for a 100,000-character name
MIN_RUN_CHARS = 48  # how far a run is shortened when the whole line is too long
_LONG_RUN = re.compile(r"\S{%d,}" % (MAX_RUN_CHARS + 1))


def _shorten(text: str, limit: int) -> str:
    """Keep the start and the end (where file names and extensions are), elide the middle."""
    if len(text) <= limit:
        return text
    tail = limit // 4
    return text[:limit - tail - 3] + "..." + text[len(text) - tail:]


def quote(value, limit: int = MAX_VALUE_CHARS) -> str:
    """A value as Python's repr writes it (escaped: no newline, no control character), at most `limit` chars."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    text = repr(value).encode("utf-8", "backslashreplace").decode("utf-8")  # lone surrogates from the OS
    return _shorten(text, limit)


def one_line(message: str, limit: int = MAX_LINE_CHARS - len("error: ")) -> str:
    """Control characters escaped, each overlong unbroken run shortened, the whole at most `limit` chars."""
    text = str(message).encode("utf-8", "backslashreplace").decode("utf-8")
    text = "".join(c if c.isprintable() or c == " " else repr(c)[1:-1] for c in text)
    text = _LONG_RUN.sub(lambda m: _shorten(m.group(), MAX_RUN_CHARS), text)
    # still too long: shorten the longest unbroken runs (paths) first, so the words that explain survive
    while len(text) > limit:
        runs = [m for m in re.finditer(r"\S{%d,}" % (MIN_RUN_CHARS + 1), text)]
        if not runs:
            break
        run = max(runs, key=lambda m: len(m.group()))
        keep = max(MIN_RUN_CHARS, len(run.group()) - (len(text) - limit))
        text = text[:run.start()] + _shorten(run.group(), keep) + text[run.end():]
    return _shorten(text, limit)


class Llama32Error(Exception):
    """Base class: a clear, one-line problem with the user's input."""

    def __init__(self, message: str = "", *args):
        super().__init__(one_line(message), *args)


class CheckpointError(Llama32Error):
    """A checkpoint file (safetensors, GGUF, index, tokenizer, adapter) is missing or malformed."""


class ConfigError(Llama32Error):
    """config.json (or GGUF metadata) is missing a field, has a wrong type, or describes an unsupported model."""


class GenerationError(Llama32Error):
    """A run-time argument is out of range: prompt, token ids, sampling settings, context length, device."""


class NonFiniteError(Llama32Error):
    """NaN or Inf appeared in an activation; the message names the first one."""


class ImageError(Llama32Error):
    """An image file cannot be read (not an image, truncated, too many pixels, a mode with no RGB conversion)."""


class QuantError(Llama32Error):
    """A quantization request or a quantized tensor that cannot be used."""


class DataError(Llama32Error):
    """A training or evaluation data file (JSONL) is malformed: the message names the file and line."""
