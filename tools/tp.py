"""`--tp N`: the CLI side of tensor parallelism (accel.tp). generate, chat, batch and serve run it, bench measures it
(tools/bench/tp.py), golden check checks its logits, diff compares its activations gathered whole (accel.tp.trace)."""
from __future__ import annotations

import os
import time
from pathlib import Path

import click

from refimpl.errors import GenerationError
from tools.engines import parse_quant

TP_OPTION = click.option("--tp", type=click.IntRange(min=1), default=1, show_default=True,
                         help="Tensor parallel over N processes (one a GPU; --device cpu: gloo on the CPU). Started "
                              "here, or one a rank under torchrun --nproc-per-node N. Llama 3.2 text and Vision "
                              "models, accel backend.")


def check_tp(tp: int, backend: str, **unsupported) -> None:
    """unsupported: options --tp does not take yet, by flag name -> value given (None / False / () if not)."""
    given = [flag for flag, value in unsupported.items() if value]
    if given:
        raise GenerationError(f"--tp {tp} does not take {given[0]} yet; drop one of them")
    if backend == "refimpl":
        raise GenerationError(f"--tp {tp} runs on the accel backend (torch.distributed); drop --backend refimpl")


def load_tp(model_path: Path, tp: int, backend: str, device: str | None, dtype: str | None, quant: str | None = None,
            **unsupported):
    """(rank 0's accel.tp engine, the checkpoint without weights, load seconds), released with the click command's
    context. quant: --quant's text (int8 / int4: each rank quantizes its slices). unsupported: options --tp does
    not take yet, by flag name -> value given (None / False / () if not)."""
    check_tp(tp, backend, **unsupported)
    try:
        from accel.tp.launch import tp_engine
    except ImportError as e:
        raise GenerationError(f"--tp needs torch ({e})") from None
    spec = parse_quant(quant)
    t0 = time.perf_counter()
    engine, ckpt = click.get_current_context().with_resource(tp_engine(model_path, tp, device, dtype, spec))
    return engine, ckpt, time.perf_counter() - t0


def _batch_launch():
    try:
        from accel.tp import batch_launch
    except ImportError as e:
        raise GenerationError(f"--tp needs torch ({e})") from None
    return batch_launch


def tp_checkpoint(model_path: Path, tp: int, device: str | None, dtype: str | None, **options):
    """The checkpoint without weights (config, tokenizer, stop ids) that rank 0 reads requests with, before any
    rank starts. Under torchrun a rank other than 0 goes from here straight to following rank 0's batch engine (it
    reads no input, prints nothing but its errors) and exits. options: the batch engine's (tp_batch_engine)."""
    launch = _batch_launch()
    from accel.tp.group import under_torchrun
    from accel.tp.load import open_text_checkpoint
    if under_torchrun() and os.environ["RANK"] != "0":
        with launch.tp_batch_engine(model_path, tp, device, dtype, **options):
            pass  # never reached: a follower exits in there
    return open_text_checkpoint(model_path, world=tp)


def load_tp_batch(model_path: Path, tp: int, device: str | None, dtype: str | None, **options):
    """Rank 0's batch engine over the group (accel.tp.batch.TPBatchEngine), released with the click command's
    context (the other ranks then stop)."""
    engine, _ = click.get_current_context().with_resource(
        _batch_launch().tp_batch_engine(model_path, tp, device, dtype, **options))
    return engine


def under_torchrun_once(tp: int, groups: int, what: str) -> None:
    """Under torchrun a process joins one group: refuse a command that would start several (one a model)."""
    from accel.tp.group import under_torchrun
    if tp > 1 and groups > 1 and under_torchrun():
        raise GenerationError(f"--tp {tp} under torchrun runs one model: give one {what}, not {groups}")
