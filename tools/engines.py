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
                lora: Path | None = None, lora_mode: str = "merged"):
    """Returns (engine, checkpoint, load seconds). Engines share `generate`, `steps`, `new_cache`, `config`.

    `lora`: a PEFT adapter directory, merged into the fp32 weights before any engine sees them ("merged"), or kept
    beside the untouched base weights and added at run time ("unmerged", refimpl only)."""
    t0 = time.perf_counter()
    if lora is not None and lora_mode == "unmerged" and backend != "refimpl":
        raise GenerationError("--lora-mode unmerged runs on --backend refimpl only (accel serves merged adapters)")
    ckpt = load_checkpoint(model_path)
    if lora is not None:
        from refimpl.formats.lora import attach_lora, load_lora, merge_lora
        adapter = load_lora(lora, ckpt.config)
        ckpt.params = (attach_lora(ckpt.params, adapter) if lora_mode == "unmerged"
                       else merge_lora(ckpt.params, ckpt.config, adapter))
    engine = engine_for(ckpt, backend, device, dtype if backend == "accel" else None)
    return engine, ckpt, time.perf_counter() - t0


def engine_for(ckpt, backend: str, device: str | None = None, dtype: str | None = None):
    """An engine over an already loaded checkpoint (diff and step build two over one load)."""
    from refimpl.model.mllama_config import MllamaConfig
    if isinstance(ckpt.config, MllamaConfig) and backend != "refimpl":
        raise GenerationError(f"{ckpt.path}: Llama 3.2 Vision runs on the refimpl backend only for now; "
                              f"pass --backend refimpl")
    if backend == "refimpl":
        if dtype not in (None, "fp32"):
            raise GenerationError(f"--dtype {dtype}: the refimpl backend computes in fp32 only")
        if device not in (None, "cpu"):
            raise GenerationError(f"--device {device!r}: the refimpl backend runs on the CPU only")
        if isinstance(ckpt.config, MllamaConfig):
            from refimpl.generate_mllama import MllamaEngine
            return MllamaEngine(ckpt)
        from refimpl.generate import RefEngine
        return RefEngine(ckpt)
    try:
        from accel.engine import AccelEngine
    except ImportError as e:
        raise GenerationError(f"--backend accel is not available here ({e}); it needs torch and triton: "
                              f"pip install 'llama32[accel]'") from None
    return AccelEngine.from_checkpoint(ckpt, device=device, dtype=dtype)
