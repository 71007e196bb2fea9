"""Errors that mean "your input is wrong", as opposed to a bug in llama32.

The CLI catches `Llama32Error` and prints `error: <message>` as one line (exit 2); anything else is a bug and
keeps its traceback. Messages name the file, field or argument and say what was expected.
"""


class Llama32Error(Exception):
    """Base class: a clear, one-line problem with the user's input."""


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


class DataError(Llama32Error):
    """A training or evaluation data file (JSONL) is malformed: the message names the file and line."""
