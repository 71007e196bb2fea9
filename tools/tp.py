"""`--tp N`: the CLI side of tensor parallelism (accel.tp). generate and chat run it, bench measures it
(tools/bench/tp.py), golden check checks its logits; the other commands refuse it for now."""
from __future__ import annotations

import time
from pathlib import Path

import click

from refimpl.errors import GenerationError

TP_OPTION = click.option("--tp", type=click.IntRange(min=1), default=1, show_default=True,
                         help="Tensor parallel over N processes (one a GPU; --device cpu: gloo on the CPU). Started "
                              "here, or one a rank under torchrun --nproc-per-node N. Text models, accel backend.")


def refuse_tp(tp: int, command: str) -> None:
    if tp > 1:
        raise GenerationError(f"--tp {tp}: llama32 {command} runs on one device for now; tensor parallel runs "
                              f"`llama32 generate`, `chat`, `bench` and `golden check` only (docs/tp.md)")


def load_tp(model_path: Path, tp: int, backend: str, device: str | None, dtype: str | None, **unsupported):
    """(rank 0's accel.tp engine, the checkpoint without weights, load seconds), released with the click command's
    context. unsupported: options --tp does not take yet, by flag name -> value given (None / False / () if not)."""
    given = [flag for flag, value in unsupported.items() if value]
    if given:
        raise GenerationError(f"--tp {tp} does not take {given[0]} yet; drop one of them")
    if backend == "refimpl":
        raise GenerationError(f"--tp {tp} runs on the accel backend (torch.distributed); drop --backend refimpl")
    try:
        from accel.tp.launch import tp_engine
    except ImportError as e:
        raise GenerationError(f"--tp needs torch ({e})") from None
    t0 = time.perf_counter()
    engine, ckpt = click.get_current_context().with_resource(tp_engine(model_path, tp, device, dtype))
    return engine, ckpt, time.perf_counter() - t0


def under_torchrun_once(tp: int, groups: int, what: str) -> None:
    """Under torchrun a process joins one group: refuse a command that would start several (one a model)."""
    from accel.tp.group import under_torchrun
    if tp > 1 and groups > 1 and under_torchrun():
        raise GenerationError(f"--tp {tp} under torchrun runs one model: give one {what}, not {groups}")
