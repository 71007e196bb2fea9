"""Choosing a model file and a backend: shared by every CLI command."""
from __future__ import annotations

import time
from pathlib import Path

from refimpl.formats.checkpoint import load_checkpoint
from refimpl.errors import GenerationError

BACKENDS = ("auto", "refimpl", "accel")


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def resolve_backend(name: str) -> str:
    """'auto' means accel where CUDA is present, else the NumPy reference."""
    if name == "auto":
        return "accel" if cuda_available() else "refimpl"
    if name == "accel":
        try:
            import torch  # noqa: F401
        except ImportError:
            raise GenerationError("--backend accel needs torch and triton: pip install 'llama32[accel]'") from None
    return name


def resolve_model(model: str | None) -> Path:
    """An explicit --model path, or the default model (SmolLM2-135M-Instruct), fetched on first use."""
    if model is not None:
        return Path(model).expanduser()
    from tools.default_model import default_model_path
    return default_model_path(fetch_if_missing=True)


def load_engine(model_path: Path, backend: str, device: str | None = None, dtype: str | None = None,
                lora: Path | None = None):
    """Returns (engine, checkpoint, load seconds). Engines share `generate`, `steps`, `new_cache`, `config`.

    `lora`: a PEFT adapter directory, merged into the fp32 weights before any engine sees them."""
    t0 = time.perf_counter()
    ckpt = load_checkpoint(model_path)
    if lora is not None:
        from refimpl.formats.lora import load_lora, merge_lora
        ckpt.params = merge_lora(ckpt.params, ckpt.config, load_lora(lora, ckpt.config))
    engine = engine_for(ckpt, backend, device, dtype if backend == "accel" else None)
    return engine, ckpt, time.perf_counter() - t0


def engine_for(ckpt, backend: str, device: str | None = None, dtype: str | None = None):
    """An engine over an already loaded checkpoint (diff and step build two over one load)."""
    if backend == "refimpl":
        if dtype not in (None, "fp32"):
            raise GenerationError(f"--dtype {dtype}: the refimpl backend computes in fp32 only")
        if device not in (None, "cpu"):
            raise GenerationError(f"--device {device!r}: the refimpl backend runs on the CPU only")
        from refimpl.generate import RefEngine
        return RefEngine(ckpt)
    try:
        from accel.engine import AccelEngine
        from accel.vision.engine import MllamaAccelEngine
    except ImportError as e:
        raise GenerationError(f"--backend accel is not available here ({e}); it needs torch and triton: "
                              f"pip install 'llama32[accel]'") from None
    if is_mllama(ckpt):
        return MllamaAccelEngine.from_checkpoint(ckpt, device=device, dtype=dtype)
    return AccelEngine.from_checkpoint(ckpt, device=device, dtype=dtype)


def is_mllama(ckpt) -> bool:
    from refimpl.model.mllama_config import MllamaConfig
    return isinstance(ckpt.config, MllamaConfig)
