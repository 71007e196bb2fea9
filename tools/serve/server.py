"""Loading what `llama32 serve` serves, and running uvicorn around it until Ctrl-C (which drains: requests in
flight finish, new connections are refused, then the engine thread stops)."""
from __future__ import annotations

import sys
from pathlib import Path

from refimpl.errors import GenerationError
from refimpl.family import family_of
from tools.chat_session import model_name
from tools.engines import resolve_model
from tools.serve.app import build_app
from tools.serve.async_engine import AsyncEngine
from tools.serve.requests import ServedModel, sampling_fields
from tools.vision_inputs import token_rows
from tools.vision_requests import VisionPrompts


def load_served(model, adapters: dict[str, Path], served_name, device, dtype, max_num_seqs: int,
                max_num_batched_tokens: int, gpu_memory: float | int, media: Path | None, api_key: str | None,
                started=None):
    """-> (the FastAPI app, the AsyncEngine, the base model's served name). started: (an engine already started with
    `adapters` loaded, its checkpoint without weights), a tensor-parallel one (tools.tp), served instead of loading
    the model here."""
    from accel.batch import BatchEngine, SamplingParams
    from refimpl.formats.checkpoint import load_checkpoint
    from refimpl.formats.lora import load_lora

    path = resolve_model(model)
    engine, ckpt = started if started is not None else (None, load_checkpoint(path))
    if ckpt.tokenizer is None:
        raise GenerationError(f"{path}: no tokenizer in the checkpoint; the server needs one to read text")
    if engine is None:
        engine = BatchEngine.from_checkpoint(ckpt, device=device, dtype=dtype, max_num_seqs=max_num_seqs,
                                             max_num_batched_tokens=max_num_batched_tokens,
                                             gpu_memory=gpu_memory)
        for name, adapter_dir in adapters.items():
            engine.add_adapter(name, load_lora(adapter_dir, ckpt.config))
    cfg = ckpt.config
    vision = family_of(cfg).takes_images
    prompts = VisionPrompts(ckpt) if vision else None
    served = ServedModel(name=served_name or model_name(path), tokenizer=ckpt.tokenizer,
                         stop_ids=tuple(ckpt.stop_ids), context=cfg.max_position_embeddings,
                         vocab_rows=token_rows(cfg), adapters=tuple(adapters), vision=vision, image_prompts=prompts,
                         allowed_media=media, sampling_fields=sampling_fields(SamplingParams))
    runner = AsyncEngine(engine)
    return build_app(runner, served, SamplingParams, api_key=api_key), runner, served.name


def bound_server(config, on_started):
    """uvicorn's Server, calling `on_started()` once its socket is bound and it accepts connections."""
    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started:
                on_started()
    return Server(config)


def run_server(app, engine: AsyncEngine, name: str, host: str, port: int) -> None:
    import uvicorn

    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=30)
    shown = f"[{host}]" if ":" in host else host
    server = bound_server(config, lambda: print(
        f"llama32 serve: {name} at http://{shown}:{port}/ (OpenAI API at http://{shown}:{port}/v1; Ctrl-C stops)",
        file=sys.stderr, flush=True))
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it caught, after draining: the stop asked for
        pass
    except SystemExit:  # uvicorn exits when it cannot start (the address is taken or unknown); it logged why
        raise GenerationError(f"cannot serve at {shown}:{port}: the server did not start (uvicorn's reason is "
                              f"above)") from None
    finally:
        engine.shutdown()
    print("llama32 serve: stopped", file=sys.stderr, flush=True)
