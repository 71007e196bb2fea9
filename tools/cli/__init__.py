"""The `llama32` command line. Every subcommand lives in its own module and registers itself here.

Errors in the user's input (`Llama32Error`) print one line on stderr and exit 2; `--debug` shows the traceback.
"""
from __future__ import annotations

import os
import sys

# The refimpl's decode is one matrix-vector product after another. On the 2-core reference machine OpenBLAS's
# threaded gemv ran at 12.8 GB/s on SmolLM2's lm_head and collapsed to 0.5 GB/s on a 1536×576 weight when another
# process held a core, while one thread ran at 31 and 92 GB/s (2026-11-21): 18.7 -> 49.6 tok/s decode.
# Must be set before NumPy loads OpenBLAS; a user's own setting wins.
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


def _print_version(ctx, param, value):
    if not value or ctx.resilient_parsing:
        return
    from tools.debug.golden import tool_version  # installed metadata, else the checkout's pyproject.toml
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


# (module in tools/cli/, click command of the same name): each command keeps its heavy imports (torch, matplotlib) inside itself,
# so `llama32 --help` and the refimpl paths start in well under a second.
COMMANDS = ("generate", "chat", "fetch", "golden", "diff", "step", "bench")


def _register():
    import importlib
    for name in COMMANDS:
        main.add_command(getattr(importlib.import_module(f"tools.cli.{name}"), name))


_register()
