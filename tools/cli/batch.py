"""`llama32 batch`: offline batch inference over a JSONL file of requests (docs/batch.md)."""
from __future__ import annotations

import importlib.util
import json

import click

from refimpl.errors import GenerationError

from tools.cli.options import BATCH_LIMIT_OPTIONS, MODEL_OPTION, Count, UserPath, parse_gpu_memory, parse_lora_dirs
from tools.tp import TP_OPTION, check_tp, load_tp_batch, tp_checkpoint

BATCH_BACKENDS = ("auto", "accel", "refimpl")


def resolve_batch_backend(name: str) -> str:
    """auto: the batch engine (accel.batch: GPU, or torch ops on CPU) where torch is installed, else the NumPy
    reference engine one request at a time."""
    if name != "auto":
        return name
    has_torch = importlib.util.find_spec("torch") is not None
    return "accel" if has_torch and importlib.util.find_spec("accel.batch") is not None else "refimpl"


@click.command()
@MODEL_OPTION
@click.option("--lora", "loras", multiple=True, metavar="NAME=DIR",
              help="A PEFT adapter the requests name in their \"adapter\" field (repeatable).")
@click.option("--input", "input_path", required=True, type=UserPath(), help="Requests, one JSON object a line.")
@click.option("--output", "output_path", required=True, type=UserPath(output=True),
              help="Results, one JSON object a line in input order; ids already there are skipped (resume).")
@click.option("--backend", type=click.Choice(BATCH_BACKENDS), default="auto", show_default=True,
              help="accel: continuous batching (GPU, or torch on CPU); refimpl: NumPy, one request at a time; "
                   "auto: accel where torch is installed.")
@click.option("--device", default=None, help="accel device, e.g. cuda:0 or cpu.")
@click.option("--dtype", type=click.Choice(["bf16", "fp32"]), default=None, help="accel weight dtype.")
@click.option("--max-tokens", default=256, show_default=True, type=Count(1),
              help="New tokens for requests without their own \"max_tokens\".")
@BATCH_LIMIT_OPTIONS
@click.option("--gpu-memory", default=None, metavar="FRACTION|BYTES",
              help="The GPU memory the engine may hold in all, a fraction (default 0.9), or the KV pool in bytes.")
@click.option("--batch-invariant", is_flag=True,
              help="Each request's tokens bit-identical whatever else shares its batch (slower).")
@click.option("--eval", "evaluate", is_flag=True,
              help="Score each text against its request's \"answer\" (exact match, edit distance, answer loss).")
@click.option("--json", "as_json", is_flag=True, help="Print the run's summary as one JSON record.")
@TP_OPTION
def batch(model, loras, input_path, output_path, backend, device, dtype, max_tokens, max_num_seqs,
          max_num_batched_tokens, gpu_memory, batch_invariant, evaluate, as_json, tp=1):
    """Run every request of a JSONL file through the model; results to a JSONL file (docs/batch.md)."""
    from refimpl.formats.checkpoint import load_checkpoint
    from refimpl.family import family_of
    from tools.batch_job import Job, run_job
    from tools.batch_requests import read_done, read_requests
    from tools.engines import resolve_model
    lora_dirs = parse_lora_dirs(loras, 'a name the requests\' "adapter" field uses')
    memory = None if gpu_memory is None else parse_gpu_memory(gpu_memory)
    backend = resolve_batch_backend(backend)
    if input_path.resolve() == output_path.resolve():
        raise GenerationError(f"--output {output_path} is the input file")
    model_path = resolve_model(model)
    options = {}
    if backend == "accel":
        options = {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
                   "batch_invariant": batch_invariant, **({"gpu_memory": memory} if memory is not None else {})}
    if tp > 1:  # rank 0 reads the requests with the tokenizer alone; the ranks load their shards after
        check_tp(tp, backend, **{"--eval": evaluate, "--batch-invariant": batch_invariant})
        options.pop("batch_invariant")
        options["adapters"] = lora_dirs  # every rank reads its part of each
        ckpt = tp_checkpoint(model_path, tp, device, dtype, **options)
    else:
        ckpt = load_checkpoint(model_path)
    if ckpt.tokenizer is None:
        raise GenerationError(f"{model_path}: no tokenizer found beside the weights")
    vision = None
    if family_of(ckpt.config).takes_images:
        for given, flag in ((lora_dirs, "--lora"), (evaluate, "--eval"), (batch_invariant, "--batch-invariant")):
            if given:
                raise GenerationError(f"{flag}: llama32 batch runs it on text models only for now ({model_path} is a "
                                      f"Llama 3.2 Vision checkpoint)")
        from tools.vision_requests import VisionPrompts
        vision = VisionPrompts(ckpt, input_path)
    requests = read_requests(input_path, ckpt.tokenizer, ckpt.config.max_position_embeddings, max_tokens,
                             adapters=tuple(lora_dirs), vision=vision, need_answer=evaluate)
    from refimpl.formats.lora import load_lora
    adapters = {name: load_lora(path, ckpt.config) for name, path in lora_dirs.items()}  # all checked up front
    done = read_done(output_path, {r.id for r in requests})
    for note in (n for r in requests if r.id not in done for n in r.notes):
        click.echo(f"note: {note}", err=True)
    if done:
        click.echo(f"resuming: {len(done)} of {len(requests)} requests already in {output_path}", err=True)
    job = Job(requests, done, output_path, ckpt, adapters, backend, device, dtype, options, evaluate)
    if tp > 1:
        job.engine = load_tp_batch(model_path, tp, device, dtype, **options)
    summary = {"model": str(model_path), "backend": backend, **run_job(job)}
    if as_json:
        click.echo(json.dumps(summary))
        return
    rate = summary["output_tokens_per_s"]
    click.echo(f"[{backend}] {summary['completed']} requests done ({summary['resumed']} resumed), "
               f"{summary['completion_tokens']} new tokens in {summary['elapsed_s']:.1f} s"
               f"{f', {rate:.1f} tok/s' if rate else ''} -> {output_path}")
    if evaluate:
        from tools.batch_eval import render_summary
        click.echo(render_summary(summary["eval"]))
