"""A golden record, whatever model it is of: the manifest's format, the recorded steps, the activations file, and
recording a reference engine's steps. tools/debug/golden.py (text toys) and vision_golden.py (the vision toy) write
and check it.

A golden record lives beside its toy checkpoint (golden/<toy>/):
    golden.json           manifest: format + version, config fingerprint, token ids and positions per step, dtype,
                          the tool that made it, and the max logit difference HF transformers showed at that time
    golden.safetensors    fp32 activations keyed "<step>/<name>" ("prefill/layers.0.attn.q", "decode0/logits")
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from refimpl.errors import Llama32Error
from refimpl.formats.safetensors_io import SafetensorsFile

FORMAT, FORMAT_VERSION = "llama32-golden", 1
MANIFEST, ACTIVATIONS = "golden.json", "golden.safetensors"
DEFAULT_DIR = Path(__file__).resolve().parents[2] / "golden"
DECODE_STEPS = 2


class GoldenError(Llama32Error):
    """A golden record is missing, stale, foreign, or does not match its checkpoint."""


def tool_version() -> str:
    """The package version: installed metadata, else the checkout's pyproject.toml."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return f"llama32 {version('llama32')}"
    except PackageNotFoundError:
        import tomllib
        pyproject = DEFAULT_DIR.parent / "pyproject.toml"
        return f"llama32 {tomllib.loads(pyproject.read_text())['project']['version']}"


def regenerate_hint(model_dir: Path) -> str:
    root = model_dir.resolve().parent
    return "regenerate with `llama32 golden make" + ("`" if root == DEFAULT_DIR else f" --out {root}`")


# ---------------------------------------------------------------- recording

@dataclass(frozen=True)
class Step:
    name: str  # "prefill", "decode0", ...
    ids: list[int]
    positions: list[int]


def record(engine, prompt_ids: list[int], decode_steps: int, **inputs) -> tuple[list[Step], dict[str, np.ndarray]]:
    """Prefill + greedy decode steps on a fresh cache; every activation as "<step>/<name>" -> fp32 array.
    `inputs`: a multimodal engine's prompt inputs (images), given to the prefill only."""
    cache = engine.new_cache(len(prompt_ids) + decode_steps)
    steps, acts = [Step("prefill", list(prompt_ids), list(range(len(prompt_ids))))], {}
    while True:
        step = steps[-1]
        for name, value in engine.steps(step.ids, step.positions, cache, **(inputs if len(steps) == 1 else {})):
            acts[f"{step.name}/{name}"] = np.array(engine.to_numpy(value), np.float32)
        if len(steps) > decode_steps:
            return steps, acts
        token = int(np.argmax(acts[f"{step.name}/logits"][-1]))  # greedy: the next id a user would see
        pos = step.positions[-1] + 1
        steps.append(Step(f"decode{len(steps) - 1}", [token], [pos]))


def logits_check(theirs: np.ndarray, steps: list[Step], acts: dict[str, np.ndarray], version: str) -> dict:
    """A manifest's hf_check: HF's logits [T, V] over the whole sequence against ours from the cached steps."""
    ours = np.concatenate([acts[f"{s.name}/logits"] for s in steps])  # [T, V]
    max_abs = float(np.abs(theirs - ours).max())
    # two significant digits: summation order may move the last bits between runs, the record must not
    return {"transformers": version, "max_abs_logits": float(f"{max_abs:.1e}"),
            "max_abs_ref_logits": float(f"{np.abs(ours).max():.3g}")}


@dataclass
class GoldenRecord:
    model_dir: Path
    manifest: dict
    steps: list[Step]
    tensors: SafetensorsFile

    def get(self, step: str, name: str) -> np.ndarray:
        return self.tensors.load(f"{step}/{name}")


def find_golden_dirs(root: str | Path) -> list[Path]:
    """`root` itself if it holds a manifest, else its subdirectories that do."""
    root = Path(root)
    if (root / MANIFEST).exists():
        return [root]
    found = sorted(p.parent for p in root.glob(f"*/{MANIFEST}")) if root.is_dir() else []
    if not found:
        raise GoldenError(f"{root}: no {MANIFEST} here or in its subdirectories; create the golden files with "
                          f"`llama32 golden make --out {root}`")
    return found


def parse_steps(manifest: dict, where: str) -> list[Step]:
    raw = manifest.get("steps")
    ok = isinstance(raw, list) and raw and all(
        isinstance(s, dict) and isinstance(s.get("name"), str) and isinstance(s.get("ids"), list)
        and isinstance(s.get("positions"), list) and len(s["ids"]) == len(s["positions"]) > 0
        and all(isinstance(i, int) for i in s["ids"] + s["positions"]) for s in raw)
    if not ok:
        raise GoldenError(f"{where}: 'steps' must be a list of {{name, ids, positions}} with equal-length integer "
                          f"lists")
    return [Step(s["name"], s["ids"], s["positions"]) for s in raw]


