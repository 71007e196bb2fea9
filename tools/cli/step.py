"""`llama32 step`: step through one token's forward an op at a time, on one backend or two in lockstep.

The session logic lives in tools/debug/stepper.py; this module only turns options into engines and feeds commands:
from --commands, from stdin when it is not a terminal (scripts, CI), or from a `(llama32) ` prompt.
"""
from __future__ import annotations

import sys

import click

from refimpl.formats.checkpoint import load_checkpoint
from refimpl.errors import GenerationError

from tools.cli.options import MODEL_OPTION, QUANT_HELP, UserPath
from tools.engines import engine_for, parse_quant, resolve_model
from tools.vision_inputs import forward_names, prompt_inputs
from tools.debug.step_values import parse_inject
from tools.debug.step_script import run_script, split_commands
from tools.debug.stepper import StepSession


def make_engines(ckpt, backend: str, device: str | None, dtype: str | None) -> list:
    """refimpl first: with --backend both it is the oracle whose values the accel side is compared against."""
    sides = {"refimpl": ["refimpl"], "accel": ["accel"], "both": ["refimpl", "accel"]}[backend]
    # --device/--dtype are the accel side's; the refimpl is NumPy fp32 on the CPU
    return [engine_for(ckpt, "refimpl") if side == "refimpl" else engine_for(ckpt, "accel", device, dtype)
            for side in sides]


def interactive(session: StepSession) -> None:
    try:
        import readline  # noqa: F401  (line editing and history for input(), where the platform has it)
    except ImportError:
        pass
    while True:
        try:
            line = input("(llama32) ")
        except EOFError:
            click.echo()
            return
        if not session.run(line):
            return


@click.command()
@click.argument("prompt")
@MODEL_OPTION
@click.option("--position", default=None, type=int,
              help="Prompt position (from 0) of the token to step through [default: the last one].")
@click.option("--backend", type=click.Choice(["refimpl", "accel", "both"]), default="refimpl", show_default=True,
              help="both: refimpl and accel side by side, compared after every op.")
@click.option("--device", default=None, help="accel device, e.g. cuda:0 or cpu.")
@click.option("--quant", default=None, metavar="FORMAT",
              help=QUANT_HELP)
@click.option("--dtype", type=click.Choice(["bf16", "fp32"]), default=None,
              help="accel dtype (default bf16 on CUDA, fp32 on CPU).")
@click.option("--commands", default=None, help='Run these commands and exit, e.g. "b layers.1.*; c; p; q".')
@click.option("--inherited", is_flag=True,
              help="With --backend both: feed each backend its own outputs (default: lockstep, the second backend "
                   "gets the first's inputs at every op).")
@click.option("--inject", default=None, metavar="NAME=nan|zero|noise",
              help="Replace activation NAME in the first backend (refimpl with --backend both).")
@click.option("--image", "images", multiple=True, type=UserPath(),
              help="An image for a Llama 3.2 Vision checkpoint (repeatable), as in generate; the stepped token's "
                   "forward encodes it again, so breakpoints in vision.* and the cross-attention layers work.")
def step(prompt, model, position, backend, device, quant, dtype, commands, inherited, inject, images=()):
    """Step through the forward of one token of PROMPT, op by op.

    Stops before the first op of the token's one-token forward (after a prefill of the tokens before it) and
    reads commands: n, c, b PATTERN, bd TOL, p, show, diff, top, dump, where, list, q; h lists them.
    """
    if inherited and backend != "both":
        raise GenerationError("--inherited compares two backends: use it with --backend both")
    if backend == "refimpl" and device not in (None, "cpu"):
        raise GenerationError(f"--device {device!r}: the refimpl backend runs on the CPU only")
    if not prompt:
        raise GenerationError("the prompt is empty: give some text to step through")
    ckpt = load_checkpoint(resolve_model(model), quant=parse_quant(quant))  # both engines run the same records
    vision = prompt_inputs(ckpt, prompt, images, chat=False)
    inputs = vision.engine_kwargs if vision is not None else None
    fault = parse_inject(inject, forward_names(ckpt.config, inputs)) if inject else None
    ids = vision.ids if vision is not None else ckpt.tokenizer.encode(prompt)
    session = StepSession(make_engines(ckpt, backend, device, dtype), ids,
                      len(ids) - 1 if position is None else position, ckpt.tokenizer,
                      lockstep=not inherited, inject=fault, out=click.echo, inputs=inputs)
    session.say(*session.banner())
    if commands is None and sys.stdin.isatty():
        interactive(session)
        return
    run_script(session, split_commands(sys.stdin.read() if commands is None else commands))
    if session.failed:  # the errors are in the transcript; the exit status tells a script
        raise GenerationError(f"{len(session.failed)} scripted command(s) failed, the first: {session.failed[0]!r}")
