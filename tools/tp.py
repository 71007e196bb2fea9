"""`--tp N`: the CLI side of tensor parallelism (accel.tp). generate and chat run it; the other commands refuse it
for now."""
from __future__ import annotations

import time
from pathlib import Path

import click

from refimpl.errors import GenerationError
from tools.engines import parse_quant

TP_OPTION = click.option("--tp", type=click.IntRange(min=1), default=1, show_default=True,
                         help="Tensor parallel over N processes (one a GPU; --device cpu: gloo on the CPU). Started "
                              "here, or one a rank under torchrun --nproc-per-node N. Llama 3.2 text and Vision "
                              "models, accel backend.")


def refuse_tp(tp: int, command: str) -> None:
    if tp > 1:
        raise GenerationError(f"--tp {tp}: llama32 {command} runs on one device for now; tensor parallel runs "
                              f"`llama32 generate` and `llama32 chat` only (docs/tp.md)")


def load_tp(model_path: Path, tp: int, backend: str, device: str | None, dtype: str | None, quant: str | None = None,
            **unsupported):
    """(rank 0's accel.tp engine, the checkpoint without weights, load seconds), released with the click command's
    context. quant: --quant's text (int8 / int4: each rank quantizes its slices). unsupported: options --tp does
    not take yet, by flag name -> value given (None / False / () if not)."""
    given = [flag for flag, value in unsupported.items() if value]
    if given:
        raise GenerationError(f"--tp {tp} does not take {given[0]} yet; drop one of them")
    if backend == "refimpl":
        raise GenerationError(f"--tp {tp} runs on the accel backend (torch.distributed); drop --backend refimpl")
    try:
        from accel.tp.launch import tp_engine
    except ImportError as e:
        raise GenerationError(f"--tp needs torch ({e})") from None
    spec = parse_quant(quant)
    t0 = time.perf_counter()
    engine, ckpt = click.get_current_context().with_resource(tp_engine(model_path, tp, device, dtype, spec))
    return engine, ckpt, time.perf_counter() - t0
