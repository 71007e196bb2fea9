"""`llama32 serve`: an OpenAI-compatible HTTP server on the batched engine (needs the `serve` extra)."""
from __future__ import annotations

import os
from pathlib import Path

import click

from refimpl.errors import GenerationError
from tools.cli.options import BATCH_LIMIT_OPTIONS, MODEL_OPTION, Count, UserPath, parse_gpu_memory, parse_lora_dirs
from tools.tp import TP_OPTION, check_tp, load_tp_batch, tp_checkpoint


@click.command()
@MODEL_OPTION
@click.option("--lora", "loras", multiple=True, metavar="NAME=DIR",
              help="A PEFT LoRA adapter served under NAME (repeatable): requests pick it with \"model\": NAME.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (0.0.0.0: every interface).")
@click.option("--port", default=8000, show_default=True, type=Count(1, 65535))
@click.option("--api-key", default=None, help="Require 'Authorization: Bearer KEY' on /v1 routes (default: "
                                             "$LLAMA32_API_KEY if set).")
@click.option("--served-model-name", default=None, help="The base model's name in /v1/models (default: its file "
                                                        "or directory name).")
@BATCH_LIMIT_OPTIONS
@click.option("--gpu-memory", default="0.9", show_default=True, metavar="FRACTION|BYTES",
              help="The GPU memory the engine may hold in all (weights, a step's work and the KV pool), a "
                   "fraction, or the KV pool in bytes.")
@click.option("--allowed-local-media", default=None, type=UserPath(),
              help="A directory whose images requests may name as file:// URLs (default: none).")
@click.option("--backend", type=click.Choice(["auto", "accel"]), default="auto", show_default=True,
              help="The batched engine is accel's (torch + Triton; torch ops on CPU).")
@click.option("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when present).")
@click.option("--dtype", type=click.Choice(["bf16", "fp32"]), default=None, help="Default bf16 on GPU, fp32 on CPU.")
@click.option("--quant", default=None, metavar="FORMAT", help="Weight-only quantization (not served yet).")
@TP_OPTION
def serve(model, loras, host, port, api_key, served_model_name, max_num_seqs, max_num_batched_tokens, gpu_memory,
          allowed_local_media, backend, device, dtype, quant, tp=1):
    """Serve the model over OpenAI's HTTP API (chat, completions, models) with a chat page at /."""
    if quant is not None:
        raise GenerationError("--quant: the batched engine serves bf16/fp32 weights only for now; drop --quant")
    try:
        import uvicorn  # noqa: F401
        import fastapi  # noqa: F401
    except ImportError:
        raise GenerationError("llama32 serve needs FastAPI and uvicorn: pip install -e '.[serve]'") from None
    adapters = parse_lora_dirs(loras, "the name clients pass as 'model'")
    memory = parse_gpu_memory(gpu_memory)
    media = None
    if allowed_local_media is not None:
        media = Path(allowed_local_media).expanduser().resolve()
        if not media.is_dir():
            raise GenerationError(f"--allowed-local-media {allowed_local_media}: not a directory")
    api_key = api_key if api_key is not None else os.environ.get("LLAMA32_API_KEY") or None
    from tools.serve.server import load_served, run_server
    started = None
    if tp > 1:  # rank 0 serves HTTP; the other ranks follow its engine's steps
        from tools.engines import resolve_model
        check_tp(tp, backend)
        path = resolve_model(model)
        options = {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
                   "gpu_memory": memory, "adapters": adapters}
        ckpt = tp_checkpoint(path, tp, device, dtype, **options)
        started = load_tp_batch(path, tp, device, dtype, **options), ckpt
    app, engine, name = load_served(model, adapters, served_model_name, device, dtype, max_num_seqs,
                                    max_num_batched_tokens, memory, media, api_key, started)
    run_server(app, engine, name, host, port)
