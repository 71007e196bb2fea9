"""`llama32 golden make` / `llama32 golden check`: record the reference's activations, check a backend against them."""
from __future__ import annotations

import sys

import click

from refimpl.formats.checkpoint import load_checkpoint
from refimpl.model.names import matches

from tools.engines import engine_for
from tools.cli.options import UserPath
from tools.debug.golden import check_golden, check_golden_logits, load_golden, make_golden
from tools.debug.golden_record import DEFAULT_DIR, GoldenError, find_golden_dirs
from tools.debug.lockstep import first_divergence, report
from tools.debug.vision_golden import check_vision_golden, is_vision_golden, load_vision_golden
from tools.tp import TP_OPTION


@click.group()
def golden():
    """Golden activations of the toy checkpoints in golden/: make them, check a backend against them."""


@golden.command()
@click.option("--out", type=UserPath(output=True), default=DEFAULT_DIR, show_default=True,
              help="Where the toy checkpoints and their golden records go.")
@click.option("--hf-check/--no-hf-check", default=True, show_default=True,
              help="Record the logit difference against HF transformers (when it is installed).")
def make(out, hf_check):
    """Regenerate the toy checkpoints and golden records from the refimpl.

    Checkpoints and manifests: the same bytes everywhere. Activations: the same bytes on the same machine; on
    another CPU or BLAS build the last bits may differ, within the fp32 tolerance that `golden check` applies."""
    make_golden(out, with_hf=hf_check, log=click.echo)


def key_filter(patterns: tuple[str, ...]):
    """Globs match a name ('layers.1.*') or a step-qualified key ('decode0/logits')."""
    return lambda key: matches(key.split("/", 1)[-1], patterns) or matches(key, patterns)


@golden.command()
@click.option("--backend", type=click.Choice(["refimpl", "accel"]), default=None,
              help="The backend checked (default: refimpl; accel with --tp).")
@click.option("--dtype", type=click.Choice(["fp32", "bf16"]), default=None,
              help="accel compute dtype, and the tolerance used (default: the backend's own dtype).")
@click.option("--device", default=None, help="accel device, e.g. cuda:0 or cpu.")
@click.option("--golden", "golden_dir", type=UserPath(), default=DEFAULT_DIR, show_default=True,
              help="A golden record's directory, or a directory of them.")
@click.option("--filter", "filters", multiple=True, help="Glob over activation names, e.g. 'layers.1.attn.*' "
              "or 'decode0/*' (repeatable).")
@click.option("--isolate", is_flag=True, help="Feed every op the golden input, so each row measures one op alone.")
@click.option("--verbose", "-v", is_flag=True, help="Print every row, not just the per-layer summary.")
@TP_OPTION
def check(backend, dtype, device, golden_dir, filters, isolate, verbose, tp=1):
    """Run a backend on the recorded tokens and compare every activation; exit 1 if any is out of tolerance.
    With --tp N: each step's logits (a rank holds slices of the other activations)."""
    dirs = find_golden_dirs(golden_dir)
    backend = backend or ("accel" if tp > 1 else "refimpl")
    if tp > 1:
        _check_tp(dirs, tp, backend, dtype, device, filters, isolate)
        return
    failed = False
    for model_dir in dirs:
        if is_vision_golden(model_dir):  # the record carries its image and prompt
            rec, ckpt = load_vision_golden(model_dir), load_checkpoint(model_dir)
            rows, used = check_vision_golden(rec, ckpt, engine_for(ckpt, backend, device, dtype), dtype,
                                             key_filter(filters), isolate)
        else:
            rec = load_golden(model_dir)
            engine = engine_for(load_checkpoint(model_dir, with_tokenizer=False), backend, device, dtype)
            rows, used = check_golden(rec, engine, dtype, key_filter(filters), isolate)
        if not rows:
            raise GoldenError(f"--filter {' '.join(filters)}: matches no activation name (see refimpl/model/names.py)")
        mode = ", each op on golden inputs" if isolate else ""
        click.echo(f"== {model_dir}: {backend} ({used}{mode}) vs golden made by {rec.manifest.get('tool')}")
        for line in report(rows, used, verbose):
            click.echo(line)
        failed |= first_divergence(rows) is not None
    if failed:
        sys.exit(1)


def _check_tp(dirs, tp: int, backend: str, dtype, device, filters, isolate) -> None:
    """golden check --tp: the text records' logits, each record's model split over a group of its own; exit 1 if
    any step is out of tolerance."""
    from refimpl.errors import GenerationError
    from tools.tp import under_torchrun_once
    flag = "--filter" if filters else "--isolate" if isolate else "--backend refimpl" if backend == "refimpl" else None
    if flag:
        raise GenerationError(f"--tp {tp} checks each step's logits on the accel backend (a rank holds slices of the "
                              f"other activations); drop {flag}")
    text = [d for d in dirs if not is_vision_golden(d)]
    under_torchrun_once(tp, len(text), "golden record")
    from accel.tp.launch import tp_engine
    failed = False
    for model_dir in dirs:
        if model_dir not in text:
            click.echo(f"== {model_dir}: skipped (a Llama 3.2 Vision record; --tp runs text models)")
            continue
        rec = load_golden(model_dir)
        with tp_engine(model_dir, tp, device, dtype) as (engine, _):
            rows, used = check_golden_logits(rec, engine)
        click.echo(f"== {model_dir}: accel --tp {tp} ({used}, logits) vs golden made by {rec.manifest.get('tool')}")
        for line in report(rows, used, verbose=True):
            click.echo(line)
        failed |= first_divergence(rows) is not None
    if failed:
        sys.exit(1)
