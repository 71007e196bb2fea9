"""The `llama32` command line. Every subcommand lives in its own module and registers itself here.

Errors in the user's input (`Llama32Error`) print one line on stderr and exit 2; `--debug` shows the traceback.
"""
from __future__ import annotations

import os
import sys

# The refimpl's decode is one matrix-vector product after another, and OpenBLAS's threaded gemv collapses when
# another process holds a core (one thread decoded faster: docs/performance.md, On CPU). Must be set before NumPy
# loads OpenBLAS; a user's own setting wins.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import click

from refimpl.errors import Llama32Error, one_line


class Llama32Group(click.Group):
    """Runs a subcommand; the user's errors become one `error:` line and exit 2.

    OSError and UnicodeError are the last resort: every reader checks its paths and text first (refimpl's
    safe_open, the tokenizer), but a failure the OS reports from somewhere unforeseen (a disk that fills while
    --dump writes) is still the user's environment, not a llama32 bug, and gets one line too."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except (Llama32Error, OSError, UnicodeError) as e:
            if ctx.obj and ctx.obj.get("debug"):
                raise
            click.echo(f"error: {one_line(_describe(e))}", err=True)
            sys.exit(2)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)


def _describe(e: Exception) -> str:
    if isinstance(e, Llama32Error):
        return str(e)
    if isinstance(e, OSError):
        where = e.filename if e.filename is not None else ""
        return f"{where}: {e.strerror or e}" if where else str(e.strerror or e)
    return f"text is not valid UTF-8 ({e})"


def _print_version(ctx, param, value):
    if not value or ctx.resilient_parsing:
        return
    from tools.debug.golden_record import tool_version  # installed metadata, else the checkout's pyproject.toml
    click.echo(tool_version())
    ctx.exit()


@click.group(cls=Llama32Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show Python tracebacks for errors.")
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=_print_version,
              help="Print the version and exit.")
@click.pass_context
def main(ctx, debug):
    """Llama 3.2: a NumPy reference interpreter and a torch + Triton engine, checked against each other."""
    ctx.ensure_object(dict)["debug"] = debug


# (module in tools/cli/, click command of the same name): each command keeps its heavy imports (torch, matplotlib)
# inside itself, so `llama32 --help` and the refimpl paths start in well under a second.
COMMANDS = ("generate", "chat", "batch", "serve", "fetch", "golden", "diff", "step", "bench", "finetune", "lora",
            "quantize")


def _register():
    import importlib
    for name in COMMANDS:
        main.add_command(getattr(importlib.import_module(f"tools.cli.{name}"), name))


_register()
