"""The benchmarks' model names and shapes, their argument parser and their results record."""
from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import platform
import re
import sys
from pathlib import Path

from refimpl.model.config import PRESETS, LlamaConfig

MODELS = {"1b": "llama-3.2-1b", "3b": "llama-3.2-3b"}  # the text models the GPU benchmarks run, by short name


VISION_11B = {"image_size": 560}  # every other vision field: HF's defaults, the 11B/90B encoder
VISION_CONFIGS = {  # config.json's contents of the Llama 3.2 Vision models, by short name
    "11b-vision": {"model_type": "mllama", "vision_config": VISION_11B},  # text defaults: the 11B decoder
    "90b-vision": {"model_type": "mllama", "vision_config": VISION_11B,
                   "text_config": {"hidden_size": 8192, "num_hidden_layers": 100, "num_attention_heads": 64,
                                   "num_key_value_heads": 8, "intermediate_size": 28672,
                                   "cross_attention_layers": list(range(3, 100, 5))}},
}


def vision_config(name: str):
    """'90b-vision' -> its refimpl.model.vision_config.MllamaConfig (real shapes, for random weights)."""
    from refimpl.model.vision_config import MllamaConfig
    return MllamaConfig.from_hf(VISION_CONFIGS[name], source=name)


def model_config(key: str) -> LlamaConfig:
    """'1b' -> the Llama 3.2 1B config (real shapes; the benchmarks fill them with random weights)."""
    return PRESETS[MODELS[key]]


def decode_gemv_shapes(cfg: LlamaConfig) -> dict:
    """The decode step's GEMVs: name -> (N rows, K inputs, what the step fuses with it)."""
    D, F = cfg.hidden_size, cfg.intermediate_size
    return {"qkv": (cfg.q_size + 2 * cfg.kv_size, D, "rope"), "o": (D, cfg.q_size, "residual"),
            "gate_up": (2 * F, D, "norm"), "down": (D, F, "swiglu"), "lm_head": (cfg.vocab_size, D, "norm")}


# ---- the command line and the results record ----

def model_keys(text: str) -> list[str]:
    """'1b,3b' -> ['1b', '3b']; an unknown name is an argparse error (one line, exit 2)."""
    keys = [k.strip() for k in text.split(",") if k.strip()]
    if not keys or any(k not in MODELS for k in keys):
        raise argparse.ArgumentTypeError(f"--models {text}: expected names of {', '.join(MODELS)}")
    return keys


def parser(script: str, doc: str, models: str | None = None, json_out: bool = True) -> argparse.ArgumentParser:
    """The parser every benchmark starts from: `python3 -m <script>` in the usage, the module docstring as the
    description, --json-out (the results record; sweeps write theirs into an output folder instead), and with
    `models` a --models list defaulting to it."""
    ap = argparse.ArgumentParser(prog=f"python3 -m {script}", description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    if models is not None:
        ap.add_argument("--models", type=model_keys, default=model_keys(models),
                        help=f"comma-separated, of {', '.join(MODELS)} (default {models})")
    if json_out:
        ap.add_argument("--json-out", type=Path, default=None, help="also write the results record (JSON) here")
    return ap


def device_name(device: str = "cuda") -> str:
    """The GPU's name for a CUDA device, else the CPU's (with its core count)."""
    if str(device).startswith("cuda"):
        import torch
        return torch.cuda.get_device_name(device)
    import os
    return f"{platform.processor() or platform.machine()} CPU, {os.cpu_count()} cores"


def version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def command_line(argv: list[str] | None = None) -> str:
    """How this process was started, as a user would type it again: `python3 -m tools.bench.gpu ...`."""
    argv = sys.argv if argv is None else argv
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    head = f"python3 -m {spec.name.removesuffix('.__main__')}" if spec else Path(argv[0]).name
    return " ".join([head, *argv[1:]])


def record(device: str = "cuda", command: str | None = None, **results) -> dict:
    """The results record every benchmark writes: the command that made it, the device, the date (UTC), the
    versions of torch and triton, then the results."""
    return {"command": command or command_line(), "device": device_name(device),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "torch": version("torch"), "triton": version("triton"), **results}


def write_record(path: Path | None, rec: dict) -> None:
    """The record as indented JSON at `path` (nothing without one)."""
    if path is not None:
        Path(path).write_text(json.dumps(rec, indent=2, default=str) + "\n")


def require_cuda(script: str) -> None:
    """One error line, not a traceback, where a GPU-only benchmark starts without CUDA."""
    import torch
    if not torch.cuda.is_available():
        print(f"error: {script} needs a CUDA GPU (torch.cuda.is_available() is False here)", file=sys.stderr)
        raise SystemExit(2)


def require_gpus(ap: argparse.ArgumentParser, tp: int, script: str) -> None:
    """require_cuda, then `tp` GPUs for --tp (fewer: one argparse error line)."""
    require_cuda(script)
    import torch
    if torch.cuda.device_count() < tp:
        ap.error(f"--tp {tp} needs {tp} GPUs; this machine has {torch.cuda.device_count()}")


def table(columns: list[tuple[str, str]], rows: list[list]) -> list[str]:
    """A fixed-width table's lines, the header first: `columns` as (header, format spec such as '<14' or '>9.1f'),
    each row's cells in column order. The header and a str cell ('-' where a row has no value) take only the
    spec's alignment and width."""
    def cell(value, spec: str) -> str:
        return format(value, re.match(r"[<>^]?\d*", spec).group() if isinstance(value, str) else spec)
    return ["".join(cell(v, spec) for v, (_, spec) in zip(row, columns)) for row in [[h for h, _ in columns], *rows]]
