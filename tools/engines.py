"""Choosing a model file and a backend: shared by every CLI command."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from refimpl.formats.checkpoint import load_checkpoint
from refimpl.errors import GenerationError
from refimpl.formats.safe_open import check_path
from refimpl.family import family_of
from refimpl.quant.apply import is_quantized, refuse_requantizing

BACKENDS = ("auto", "refimpl", "accel")


# From a checkout, and with the CPU-only torch wheel first where there is no GPU (the default wheel pulls the CUDA
# toolkit, several GB)
ACCEL_HINT = ("pip install -e '.[accel]' from the checkout (on a machine without a GPU, first: pip install torch "
              "--index-url https://download.pytorch.org/whl/cpu)")


def gpu_possible() -> bool:
    """False when no GPU can be present, decided without importing torch (about a second of start-up): no NVIDIA,
    AMD or WSL2 GPU device files, or CUDA_VISIBLE_DEVICES hiding every device."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    return any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia", "/dev/kfd",
                                             "/dev/dxg"))


def cuda_available() -> bool:
    if not gpu_possible():
        return False
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def resolve_backend(name: str) -> str:
    """'auto' means accel where CUDA is present, else the NumPy reference (on CPU it decoded faster than accel's
    fp32 torch path in our runs, and starts without importing torch: docs/performance.md)."""
    if name == "auto":
        return "accel" if cuda_available() else "refimpl"
    if name == "accel":
        try:
            import torch  # noqa: F401
        except ImportError:
            raise GenerationError(f"--backend accel needs torch and triton: {ACCEL_HINT}") from None
    return name


def resolve_model(model: str | None) -> Path:
    """An explicit --model path, a Hub id found in the local Hugging Face cache, or the default model
    (SmolLM2-135M-Instruct), fetched on first use."""
    if model is not None:
        path = check_path(model, "--model", GenerationError).expanduser()
        from tools.hf_cache import looks_like_repo_id, resolve_repo_id
        if not path.exists() and looks_like_repo_id(model):
            return resolve_repo_id(model)
        return path
    from tools.default_model import default_model_path
    return default_model_path(fetch_if_missing=True)


def parse_quant(quant: str | None):
    """`--quant` text -> refimpl.quant.schemes.QuantSpec, or None."""
    if quant is None:
        return None
    from refimpl.quant.schemes import QuantSpec
    return QuantSpec.parse(quant)


def load_engine(model_path: Path, backend: str, device: str | None = None, dtype: str | None = None,
                lora: Path | None = None, lora_mode: str = "merged", quant: str | None = None):
    """Returns (engine, checkpoint, load seconds). Engines share `generate`, `steps`, `new_cache`, `config`.

    `lora`: a PEFT adapter directory, merged into the fp32 weights before any engine sees them ("merged"), or kept
    beside the untouched base weights and added at run time ("unmerged", refimpl only).
    `quant` (`--quant`): int8/int4 quantize after the merge (accel on its device, the refimpl in NumPy: the same
    bits); gguf keeps a GGUF file's blocks."""
    t0 = time.perf_counter()
    if lora is not None and lora_mode == "unmerged" and backend != "refimpl":
        raise GenerationError("--lora-mode unmerged runs on --backend refimpl only (accel serves merged adapters)")
    spec = parse_quant(quant)
    keep_blocks = spec is not None and spec.format == "gguf"
    if keep_blocks and lora is not None:
        raise GenerationError("--lora cannot be merged into --quant gguf's quantized blocks; use --quant int8/int4")
    if spec is not None and lora is not None and lora_mode == "unmerged":
        raise GenerationError("--quant needs a merged adapter: drop --lora-mode unmerged")
    ckpt = load_checkpoint(model_path, quant=spec if keep_blocks else None)
    refuse_requantizing(ckpt.params, spec, model_path)
    if lora is not None and is_quantized(ckpt.params):
        raise GenerationError(f"{model_path}: --lora cannot be merged into quantized weights; quantize the merged "
                              f"model instead")
    if lora is not None:
        from refimpl.formats.lora import attach_lora, load_lora, merge_lora
        adapter = load_lora(lora, ckpt.config)
        prefix = family_of(ckpt.config).decoder_prefix
        outside = [name for name, *_ in adapter if not name.startswith(prefix)]
        if outside and lora_mode == "unmerged":  # the refimpl vision tower runs plain linears
            raise GenerationError(f"--lora-mode unmerged serves a vision model's text-decoder adapters only; {lora} "
                                  f"also adapts {outside[0]!r}: drop --lora-mode unmerged to merge it")
        ckpt.params = (attach_lora(ckpt.params, adapter) if lora_mode == "unmerged"
                       else merge_lora(ckpt.params, ckpt.config, adapter))
    if spec is not None and not keep_blocks and backend == "refimpl":
        from refimpl.quant.apply import quantize_params
        ckpt.params = quantize_params(ckpt.params, ckpt.config, spec)
    if backend == "refimpl" and dtype == "fp32":
        print("note: --dtype fp32 changes nothing for the refimpl backend, which always computes in fp32",
              file=sys.stderr)
    engine = engine_for(ckpt, backend, device, dtype,
                        quant=spec if not keep_blocks and backend == "accel" else None)
    return engine, ckpt, time.perf_counter() - t0


def engine_for(ckpt, backend: str, device: str | None = None, dtype: str | None = None, quant=None):
    """An engine over an already loaded checkpoint (diff and step build two over one load). `quant`: a QuantSpec
    accel quantizes with on its device (a checkpoint already holding quantized records runs them as they are)."""
    if backend == "refimpl":
        if dtype not in (None, "fp32"):
            raise GenerationError(f"--dtype {dtype}: the refimpl backend computes in fp32 only")
        if device not in (None, "cpu"):
            raise GenerationError(f"--device {device!r}: the refimpl backend runs on the CPU only")
        return family_of(ckpt.config).engine(ckpt)
    try:
        from accel.family import ENGINES
    except ImportError as e:
        raise GenerationError(f"--backend accel is not available here ({e}); it needs torch and triton: "
                              f"{ACCEL_HINT}") from None
    return ENGINES[family_of(ckpt.config).name].from_checkpoint(ckpt, device=device, dtype=dtype, quant=quant)
