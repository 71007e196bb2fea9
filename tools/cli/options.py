"""Click parameter types for the llama32 CLI: what a malformed value is (click's usage error, its convention) is
kept apart from a value out of range (the project's one `error:` line, exit 2). Also the options several commands
share, declared once.

`--max-new-tokens ten` is a usage error: click prints its usage block. `--steps -1` is a well-formed number the
command cannot use: it raises GenerationError like every other bad input, so it reads the same as the rest.
"""
from __future__ import annotations

import math
import stat
from pathlib import Path

import click

from refimpl.errors import GenerationError, quote
from refimpl.formats.safe_open import check_path, stat_path
from refimpl.quant.schemes import MIXED_INT8
from tools.engines import BACKENDS

_MIXED = [k.split(".")[-1] for k in MIXED_INT8]
# --quant's help, once for generate, diff, step and quantize; :mixed's list is read from MIXED_INT8 itself.
QUANT_HELP = ("Weight-only quantization: int8 (a scale a row), int4[:G] (G = 32, 64, 128; default 64), int4[:G]:mixed "
              f"(int4 with {', '.join(_MIXED[:-1])} and {_MIXED[-1]} in int8), or gguf (at load time only: keep a "
              "GGUF file's Q8_0/Q4_0/Q4_1 blocks); append :bf16-head to keep the lm_head unquantized.")


def _option_name(param) -> str:
    return (param.opts[-1] if getattr(param, "opts", None) else param.human_readable_name) if param else "value"


class Count(click.ParamType):
    """An integer in [low, high]: not an integer is click's usage error, out of range is GenerationError."""

    name = "integer"

    def __init__(self, low: int | None = 0, high: int | None = None):
        self.low, self.high = low, high

    def convert(self, value, param, ctx):
        number = click.INT.convert(value, param, ctx)
        if (self.low is not None and number < self.low) or (self.high is not None and number > self.high):
            bounds = (f"between {self.low} and {self.high}" if self.low is not None and self.high is not None
                      else f">= {self.low}" if self.low is not None else f"<= {self.high}")
            raise GenerationError(f"{_option_name(param)} must be {bounds}, got {number}")
        return number


class UserPath(click.ParamType):
    """A path the user typed: refused if no file name could hold it (NUL). `output` paths must have an existing
    parent directory (a typo in --dump's directory is reported before an hour of work, not after)."""

    name = "path"

    def __init__(self, output: bool = False):
        self.output = output

    def convert(self, value, param, ctx):
        path = check_path(value, _option_name(param), GenerationError)
        if self.output:
            parent = path.expanduser().absolute().parent
            st = stat_path(parent, f"the directory of {_option_name(param)}", GenerationError)
            if st is None or not stat.S_ISDIR(st.st_mode):
                raise GenerationError(f"{_option_name(param)} {path}: directory {parent} does not exist")
        return Path(path)


def options(*decorators):
    """Several click options as one decorator, shown in --help in the order given."""
    def apply(f):
        for option in reversed(decorators):
            f = option(f)
        return f
    return apply


MODEL_OPTION = click.option(
    "--model", "model", default=None,
    help="Model directory, .gguf file, or Hub id in the local HF cache (default: SmolLM2-135M-Instruct).")


def sampling_options(repetition_help: str):
    """generate's and chat's sampling settings (refimpl.generate.Sampling)."""
    return options(
        click.option("--temperature", default=0.0, show_default=True, type=float, help="0 means greedy."),
        click.option("--top-p", default=1.0, show_default=True, type=float),
        click.option("--top-k", default=0, show_default=True, type=int, help="0 disables top-k."),
        click.option("--repetition-penalty", default=1.0, show_default=True, type=float, help=repetition_help),
        click.option("--seed", default=None, type=int, help="Same seed, same tokens."))


ENGINE_OPTIONS = options(
    click.option("--backend", type=click.Choice(BACKENDS), default="auto", show_default=True,
                 help="auto: accel when CUDA is present, else refimpl."),
    click.option("--device", default=None, help="accel device, e.g. cuda:0 or cpu."),
    click.option("--dtype", type=click.Choice(["bf16", "fp32"]), default=None,
                 help="accel weight dtype (default bf16)."))


# ---- the batched engine's commands (batch, serve) ----

BATCH_LIMIT_OPTIONS = options(
    click.option("--max-num-seqs", default=256, show_default=True, type=Count(1), help="Sequences in one batch."),
    click.option("--max-num-batched-tokens", default=8192, show_default=True, type=Count(1),
                 help="Tokens (prefill chunks + decodes) in one step."))


def parse_lora_dirs(values, what: str) -> dict[str, Path]:
    """`--lora NAME=DIR` values -> {NAME: Path}, names unique; `what` says what NAME is for, in the error."""
    out = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise GenerationError(f"--lora {quote(value)}: expected NAME=DIR ({what}, and a PEFT adapter directory)")
        if name in out:
            raise GenerationError(f"--lora: adapter name {quote(name)} given twice")
        out[name] = Path(path).expanduser()
    return out


def parse_gpu_memory(text: str) -> float | int:
    """--gpu-memory: a fraction in (0, 1] of the GPU memory the engine may hold, or the KV pool in bytes."""
    try:
        number = float(text)
    except ValueError:
        number = math.nan
    if 0 < number <= 1:
        return number
    if math.isfinite(number) and number > 1 and number.is_integer():
        return int(number)
    raise GenerationError(f"--gpu-memory {quote(text)}: expected a fraction in (0, 1] or a number of bytes")
