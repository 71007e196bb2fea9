"""`llama32 diff`: run two backends on one prompt, op by op, and name the first activation where they part.

Backend a is the reference. Both see the same tokens: the prompt, then --steps greedy decode steps chosen from
a's logits (so a divergence in b cannot change what the two are asked to compute).
"""
from __future__ import annotations

import sys

import click

from refimpl.formats.checkpoint import load_checkpoint
from refimpl.errors import GenerationError
from refimpl.formats.safetensors_io import save_safetensors

from tools.engines import resolve_model
from tools.vision_inputs import prompt_inputs
from tools.engines import engine_for, parse_quant
from tools.debug.diff import diff_engines
from tools.debug.lockstep import first_divergence, report
from tools.cli.golden import key_filter
from tools.cli.options import MODEL_OPTION, QUANT_HELP, Count, UserPath
from tools.tp import TP_OPTION


@click.command()
@click.argument("prompt")
@MODEL_OPTION
@click.option("--a", "a_backend", type=click.Choice(["refimpl", "accel"]), default="refimpl", show_default=True,
              help="The reference side.")
@click.option("--b", "b_backend", type=click.Choice(["refimpl", "accel"]), default="accel", show_default=True,
              help="The side under test.")
@click.option("--dtype", type=click.Choice(["fp32", "bf16"]), default=None,
              help="accel compute dtype, and the tolerance used (default: the engines' own; bf16 if either is).")
@click.option("--device", default=None, help="accel device, e.g. cuda:0 or cpu.")
@click.option("--quant", default=None, metavar="FORMAT",
              help=QUANT_HELP)
@click.option("--steps", "decode_steps", default=2, show_default=True, type=Count(0, 1024),
              help="Greedy decode steps after the prefill.")
@click.option("--chat/--no-chat", default=False, help="Wrap the prompt in the model's chat template.")
@click.option("--filter", "filters", multiple=True, help="Glob over activation names (repeatable).")
@click.option("--isolate", is_flag=True, help="Feed b a's input to every op, so each row measures one op alone.")
@click.option("--dump", type=UserPath(output=True), default=None,
              help="Save both sides' activations (safetensors, keys a/<step>/<name>, b/<step>/<name>).")
@click.option("--plot", type=UserPath(output=True), default=None,
              help="Draw the error per layer to a PNG (needs matplotlib).")
@click.option("--verbose", "-v", is_flag=True, help="Print every row, not just the per-layer summary.")
@click.option("--image", "images", multiple=True, type=UserPath(),
              help="An image for a Llama 3.2 Vision checkpoint (repeatable), as in generate.")
@TP_OPTION
def diff(prompt, model, a_backend, b_backend, dtype, device, quant, decode_steps, chat, filters, isolate, dump, plot,
         verbose, images=(), tp=1):
    """Compare backends --a and --b activation by activation on PROMPT; exit 1 if they diverge. With --tp N, b is
    the accel backend split over N ranks (what a rank holds a slice of gathered whole), a as given: --a accel
    compares it against --tp 1."""
    if tp > 1:
        b_engine = tp_side(model, tp, b_backend, dtype, device, quant, isolate)  # before any load
    if plot:
        from tools.debug.plot import require_matplotlib
        require_matplotlib()
    ckpt = load_checkpoint(resolve_model(model), quant=parse_quant(quant))  # both engines run the same records
    if not prompt:
        raise GenerationError("the prompt is empty: give some text to compare on")
    tok = ckpt.tokenizer
    vision = prompt_inputs(ckpt, prompt, images, chat)
    if vision is not None:
        prompt_ids = vision.ids
    else:
        prompt_ids = tok.encode_chat([{"role": "user", "content": prompt}]) if chat else tok.encode(prompt)
    if len(prompt_ids) + decode_steps > ckpt.config.max_position_embeddings:
        raise GenerationError(f"prompt ({len(prompt_ids)} tokens) + --steps ({decode_steps}) exceeds the context "
                              f"of {ckpt.config.max_position_embeddings} positions")
    a = engine_for(ckpt, a_backend, device if a_backend == "accel" else None, dtype if a_backend == "accel" else None)
    b = b_engine if tp > 1 else engine_for(ckpt, b_backend, device, dtype)
    dumped = {} if dump else None
    rows, used = diff_engines(a, b, prompt_ids, decode_steps, dtype, key_filter(filters), isolate, dumped,
                              vision.engine_kwargs if vision is not None else None)
    if not rows:
        raise GenerationError(f"--filter {' '.join(filters)}: matches no activation name (see refimpl/model/names.py)")
    mode = ", each op on a's inputs" if isolate else f", b over --tp {tp}" if tp > 1 else ""
    click.echo(f"== {ckpt.path}: a={a_backend} vs b={b_backend} ({used}{mode}), {len(prompt_ids)} prompt tokens + "
               f"{decode_steps} decode steps")
    for line in report(rows, used, verbose):
        click.echo(line)
    if dumped is not None:
        save_safetensors(dump, dumped, metadata={"a": a_backend, "b": b_backend, "model": str(ckpt.path)})
        click.echo(f"wrote {len(dumped)} tensors to {dump}")
    if plot:
        from tools.debug.plot import plot_errors
        plot_errors(rows, plot, used, f"{ckpt.path.name}: {b_backend} vs {a_backend} ({used})")
        click.echo(f"wrote {plot}")
    if first_divergence(rows) is not None:
        sys.exit(1)


def tp_side(model, tp: int, b_backend: str, dtype, device, quant, isolate):
    """The --tp side (b): rank 0's accel.tp engine, the other ranks started (under torchrun they follow it from
    here and exit, before the reference side loads anything)."""
    from tools.tp import load_tp
    if isolate:
        raise GenerationError(f"--tp {tp} does not take --isolate (it would feed a's values to every rank's slices); "
                              f"drop one of them")
    if b_backend != "accel":
        raise GenerationError(f"--tp {tp} splits the accel backend: give --b accel")
    path = resolve_model(model)
    from accel.tp.launch import engine_class
    from accel.tp.engine import TPEngine
    if engine_class(path) is not TPEngine:
        raise GenerationError(f"--tp {tp}: llama32 diff splits Llama 3.2 text models; {path} is a Vision model "
                              f"(check it with `llama32 generate --tp {tp}` against --tp 1)")
    engine, _, _ = load_tp(path, tp, b_backend, device, dtype, quant)
    return engine
