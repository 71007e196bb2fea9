"""`llama32 finetune`: LoRA fine-tuning on chat JSONL; the output directory is a PEFT adapter.

Base weights stay frozen in the model dtype; LoRA matrices and optimiser state are fp32. Samples are right-padded
per micro-batch (not packed): causal attention needs no mask then, and each sample's loss is exactly what it
would be alone, which keeps the one-step check against HF + PEFT exact. A Llama 3.2 Vision checkpoint also takes
image samples; its LoRA goes on the text decoder, the vision encoder stays frozen (accel.train.vision_training).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from refimpl.errors import GenerationError
from refimpl.train.data import parse_columns, read_records, record_messages

from tools.cli.outdir import check_out_dir
from tools.cli.options import MODEL_OPTION
from tools.engines import resolve_model


def _targets(spec: str) -> tuple[str, ...]:
    from refimpl.formats.lora_targets import LLAMA_LINEARS
    if spec == "all-linear":
        return LLAMA_LINEARS
    names = tuple(t.strip() for t in spec.split(",") if t.strip())
    bad = [t for t in names if t not in LLAMA_LINEARS]
    if bad or not names:
        raise GenerationError(f"--target: unknown module {bad[0] if bad else spec!r} (expected all-linear or a "
                              f"comma-separated list of {', '.join(LLAMA_LINEARS)})")
    return names


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise GenerationError(message)


def check_records(path: Path, columns: dict) -> None:
    """Every record of a data file in an accepted format (refimpl.train.data.record_messages), read before torch
    is imported; image content parts are checked later, against the checkpoint."""
    for n, record in read_records(path):
        record_messages(record, f"{path}:{n}", content_ok=lambda content, where: True, columns=columns)


def _device(torch, device: str | None) -> str:
    """--device, checked against what this machine has: one error line, never a traceback from deep in torch."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise GenerationError(f"--device {device!r} is not a torch device (e.g. cuda, cuda:1, cpu)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise GenerationError(f"--device {device}: this machine has no CUDA device that torch {torch.__version__} "
                              f"can use; use --device cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise GenerationError(f"--device {device}: there are {torch.cuda.device_count()} CUDA device(s) "
                              f"(cuda:0 to cuda:{torch.cuda.device_count() - 1})")
    if dev.type not in ("cuda", "cpu"):
        raise GenerationError(f"--device {device}: training runs on cuda or cpu")
    return device


@click.command()
@MODEL_OPTION
@click.option("--data", required=True, type=click.Path(path_type=Path),
              help="Training JSONL: messages, query/response, alpaca (instruction/input/output), sharegpt "
                   "(conversations) or math (input/output/answer) records (docs/finetuning.md); plus images "
                   "for a vision checkpoint.")
@click.option("--columns", default=None, metavar="MAPPING",
              help='Read other field names as these: a JSON object or pairs, e.g. \'{"question": "query", '
                   '"solution": "response"}\' or question=query,solution=response.')
@click.option("--out", required=True, type=click.Path(path_type=Path),
              help="Output PEFT adapter directory: new or empty (see --overwrite).")
@click.option("--overwrite", is_flag=True,
              help="Write into an --out that already holds files (an adapter is replaced). Continuing to train the "
                   "adapter in --out needs no flag: --init-adapter OUT --out OUT.")
@click.option("--eval-data", type=click.Path(path_type=Path), default=None, help="JSONL evaluated after training.")
@click.option("--rank", default=8, show_default=True, type=int)
@click.option("--alpha", default=32.0, show_default=True, type=float)
@click.option("--dropout", default=None, type=float,
              help="LoRA dropout on the adapter input [default: 0.05; with --init-adapter, the adapter's own "
                   "lora_dropout].")
@click.option("--target", default="all-linear", show_default=True,
              help="all-linear or e.g. q_proj,v_proj (a vision checkpoint: its text decoder's linears only).")
@click.option("--lr", default=1e-4, show_default=True, type=float)
@click.option("--optimizer", type=click.Choice(["adamw", "sgd"]), default="adamw", show_default=True,
              help="sgd: plain p -= lr·grad (no momentum, no weight decay).")
@click.option("--weight-decay", default=0.0, show_default=True, type=float, help="AdamW's decoupled decay.")
@click.option("--warmup-steps", default=0, show_default=True, type=int)
@click.option("--epochs", default=1, show_default=True, type=int)
@click.option("--max-steps", default=None, type=int, help="Stop after N optimiser steps (overrides --epochs).")
@click.option("--batch-size", default=1, show_default=True, type=int)
@click.option("--grad-accum", default=1, show_default=True, type=int, help="Micro-batches per optimiser step.")
@click.option("--max-length", default=2048, show_default=True, type=int,
              help="Longer samples are skipped (with a warning naming their lines), never truncated.")
@click.option("--seed", default=0, show_default=True, type=int, help="LoRA init, shuffling and dropout.")
@click.option("--init-adapter", type=click.Path(path_type=Path), default=None,
              help="Start from this PEFT adapter (its rank, alpha and targets replace --rank/--alpha/--target).")
@click.option("--save-every", default=None, type=int, help="Also write OUT/checkpoint-N every N steps.")
@click.option("--backend", type=click.Choice(["accel"]), default="accel", show_default=True)
@click.option("--device", default=None, help="cuda, cuda:1 or cpu (default: cuda when present).")
@click.option("--dtype", type=click.Choice(["bf16", "fp32"]), default=None,
              help="Base weight dtype (default bf16 on CUDA, fp32 on CPU).")
@click.option("--compile/--no-compile", "compile_layers", default=False,
              help="torch.compile the decoder layer over plain-torch ops instead of the Triton kernels (default "
                   "off: slower per step, see docs/performance.md).")
@click.option("--json", "as_json", is_flag=True, help="One JSON record per step on stdout, then a final record.")
def finetune(model, data, columns, out, overwrite, eval_data, rank, alpha, dropout, target, lr, optimizer,
             weight_decay, warmup_steps, epochs, max_steps, batch_size, grad_accum, max_length, seed, init_adapter,
             save_every, backend, device, dtype, compile_layers, as_json):
    """Fine-tune a LoRA adapter on chat data (JSONL) and write it as a PEFT adapter directory."""
    _check(rank > 0, f"--rank must be a positive integer, got {rank}")
    _check(alpha > 0, f"--alpha must be positive, got {alpha}")
    _check(dropout is None or 0 <= dropout < 1, f"--dropout must be in [0, 1), got {dropout}")
    _check(lr > 0, f"--lr must be positive, got {lr}")
    _check(weight_decay >= 0, f"--weight-decay must be >= 0, got {weight_decay}")
    for name, value in (("--epochs", epochs), ("--batch-size", batch_size), ("--grad-accum", grad_accum),
                        ("--max-length", max_length), ("--max-steps", max_steps), ("--save-every", save_every)):
        _check(value is None or value > 0, f"{name} must be a positive integer, got {value}")
    _check(warmup_steps >= 0, f"--warmup-steps must be >= 0, got {warmup_steps}")
    _check(seed >= 0, f"--seed must be >= 0, got {seed}")
    targets = _targets(target)
    resuming = init_adapter is not None and Path(init_adapter).resolve() == Path(out).resolve()
    check_out_dir(out, "--overwrite", overwrite or resuming)
    model_path = resolve_model(model)
    col_map = parse_columns(columns)
    for path in (data, eval_data) if eval_data else (data,):  # the data's mistakes before a second of torch
        check_records(path, col_map)
    try:
        import torch
    except ImportError:
        raise GenerationError("llama32 finetune needs torch: pip install 'llama32[accel]'") from None
    from accel.train.session import TrainSession, TrainSessionSettings
    from accel.train.loop import TrainSettings
    from refimpl.progress import Progress

    device = _device(torch, device)
    dtype = dtype or ("bf16" if torch.device(device).type == "cuda" else "fp32")
    warn = lambda msg: click.echo(f"warning: {msg}", err=True)  # noqa: E731
    session = TrainSession.open(model_path, data, eval_data, device, dtype, warn, TrainSessionSettings(
        rank, alpha, dropout, targets, max_length, seed, init_adapter, compile_layers, col_map))
    settings = TrainSettings(lr, optimizer, weight_decay, warmup_steps, epochs, max_steps, batch_size, grad_accum,
                             seed, save_every)
    total = session.planned_steps(settings)
    if not as_json:
        click.echo(f"finetune: {len(session.samples)} samples, {total} steps on {device} ({dtype})", err=True)
    # off a terminal (a log, a pipe) a line now and then instead of the bar; --json's records say it all
    with Progress("finetune step", total, delay_s=0.0, lines_s=None if as_json else 10.0) as bar:
        def on_step(record):
            if as_json:
                click.echo(json.dumps(record))
                sys.stdout.flush()
            tps = f"{record['tokens_per_s']:.0f}" if record["tokens_per_s"] else "-"
            bar.advance(1, f"loss {record['loss']:.4f} lr {record['lr']:.2e} {tps} tok/s")

        try:
            summary = session.train(settings, out, on_step)
        except KeyboardInterrupt:
            click.echo(f"\ninterrupted after {bar.done} steps: the adapter as it stands is saved in {out}", err=True)
            raise
    final = {"done": True, "out": str(out), **summary}
    if session.eval_samples:
        final["eval_loss"] = session.evaluate(batch_size)
    if as_json:
        click.echo(json.dumps(final))
    else:
        eval_text = f", eval loss {final['eval_loss']:.4f}" if "eval_loss" in final else ""
        click.echo(f"wrote {out} after {summary['steps']} steps ({summary['tokens']} tokens in "
                   f"{summary['seconds']:.1f} s){eval_text}", err=True)
