"""The `llama32` command line. Every subcommand lives in its own module and registers itself here.

Errors in the user's input (`Llama32Error`) print one line on stderr and exit 2; `--debug` shows the traceback.
"""
from __future__ import annotations

import os
import sys

# The refimpl's decode is one matrix-vector product after another, and OpenBLAS's threaded gemv collapses when
# another process holds a core (one thread decoded 2.7x faster; tools/bench/NOTES.md). Must be set before NumPy
# loads OpenBLAS; a user's own setting wins.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import click

from refimpl.errors import Llama32Error


class Llama32Group(click.Group):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except Llama32Error as e:
            if ctx.obj and ctx.obj.get("debug"):
                raise
            click.echo(f"error: {e}", err=True)
            sys.exit(2)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)


@click.group(cls=Llama32Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show Python tracebacks for errors.")
@click.pass_context
def main(ctx, debug):
    """Llama 3.2: a NumPy reference interpreter and a torch + Triton engine, checked against each other."""
    ctx.ensure_object(dict)["debug"] = debug


# (module in tools/cli/, click command of the same name): each command keeps its heavy imports (torch, matplotlib) inside itself,
# so `llama32 --help` and the refimpl paths start in well under a second.
COMMANDS = ("generate", "fetch", "golden", "diff", "step", "bench")


def _register():
    import importlib
    for name in COMMANDS:
        main.add_command(getattr(importlib.import_module(f"tools.cli.{name}"), name))


_register()
