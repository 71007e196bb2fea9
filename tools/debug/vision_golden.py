"""Golden activations of the toy vision checkpoint (golden/toy-vision): the same record as the text toys', plus the
image path, so `golden check` covers the image processor, the vision encoder and the cross-attention layers.

golden.json carries "kind": "vision", the raw prompt (text before and after its <|image|>), the image file (beside
the checkpoint), the processor's num_tiles / aspect_ratio_ids, and HF's logit difference at recording time;
golden.safetensors holds "inputs/pixel_values" and "inputs/cross_attention_mask" besides every activation.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import numpy as np

from refimpl.compare import TOLERANCES, compare
from refimpl.formats.jsonfile import read_json_object
from refimpl.formats.safetensors_io import SafetensorsFile, save_safetensors
from refimpl.model.vision_config import MllamaConfig
from refimpl.model.names import vision_activation_names

from tools.debug.golden_record import (ACTIVATIONS, DECODE_STEPS, FORMAT, FORMAT_VERSION, MANIFEST, GoldenError,
                                       GoldenRecord, logits_check, parse_steps, record, regenerate_hint, tool_version)
from tools.debug.lockstep import Row, compare_rows, engine_dtype

KIND = "vision"
INPUTS = ("pixel_values", "cross_attention_mask")


def is_vision_golden(model_dir: Path) -> bool:
    path = Path(model_dir) / MANIFEST
    return path.exists() and read_json_object(path, "a golden manifest", GoldenError).get("kind") == KIND


def step_names(cfg: MllamaConfig, step: str) -> list[str]:
    """The prefill encodes the image; decode steps read its keys/values from the cache."""
    prefill = step == "prefill"
    return vision_activation_names(cfg, encode_images=prefill, image_in_cache=not prefill)


def vision_request(ckpt, manifest: dict):
    """The recorded prompt and image through today's processor (part of what a check checks)."""
    from refimpl.vision.prepare import prepare
    return prepare(Path(ckpt.path), ckpt.config, ckpt.tokenizer, manifest["prompt"],
                   [Path(ckpt.path) / name for name in manifest["images"]])


def hf_check(model_dir: Path, prompt: str, image: Path, steps, acts: dict) -> dict | None:
    """HF's own processor and MllamaForConditionalGeneration over the whole sequence at once (no cache; the
    decoded tokens repeat the prompt's last cross-attention row, as HF's generate does) vs our cached steps."""
    try:
        import torch
        import transformers
    except ImportError:
        return None
    transformers.utils.logging.disable_progress_bar()
    processor = transformers.AutoProcessor.from_pretrained(model_dir)
    model = transformers.MllamaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    inputs = processor(text=prompt, images=[[str(image)]], return_tensors="pt")
    prompt_ids = inputs["input_ids"][0].tolist()
    if prompt_ids != steps[0].ids:
        raise GoldenError(f"{model_dir}: HF's processor gives prompt ids {prompt_ids}, ours {steps[0].ids}")
    decoded = [i for s in steps[1:] for i in s.ids]
    mask = inputs["cross_attention_mask"]  # [1, T, I, A]
    inputs["cross_attention_mask"] = torch.cat([mask] + [mask[:, -1:]] * len(decoded), dim=1)
    inputs["input_ids"] = torch.tensor([prompt_ids + decoded])
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    with torch.no_grad():
        theirs = model(**inputs).logits[0].numpy()  # [T, V]
    return {**logits_check(theirs, steps, acts, transformers.__version__), "prompt_ids_equal": True}


def make_vision_golden(out_root: Path, with_hf: bool = True, log: Callable = print) -> Path:
    from refimpl.formats.checkpoint import load_checkpoint
    from refimpl.generate_vision import VisionEngine

    from tools.vision_toy import TOY_PROMPT, VISION_TOY_NAME, write_vision_toy
    model_dir = write_vision_toy(out_root)
    ckpt = load_checkpoint(model_dir)
    manifest = {"format": FORMAT, "version": FORMAT_VERSION, "kind": KIND, "tool": tool_version(),
                "model": VISION_TOY_NAME, "config_fingerprint": ckpt.config.fingerprint(), "dtype": "fp32",
                "backend": "refimpl", "prompt": TOY_PROMPT, "images": ["image.png"]}
    req = vision_request(ckpt, manifest)
    steps, acts = record(VisionEngine(ckpt), req.prompt_ids, DECODE_STEPS, images=req.images)
    acts.update({f"inputs/{k}": np.asarray(getattr(req.images, k), np.float32) for k in INPUTS})
    save_safetensors(model_dir / ACTIVATIONS, acts, metadata={"format": FORMAT})
    check = hf_check(model_dir, TOY_PROMPT, model_dir / "image.png", steps, acts) if with_hf else None
    manifest.update(num_tiles=req.batch.num_tiles, aspect_ratio_ids=req.batch.aspect_ratio_ids.tolist(),
                    steps=[s.__dict__ for s in steps], activations=ACTIVATIONS, hf_check=check)
    (model_dir / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    hf = f"HF logits max |diff| {check['max_abs_logits']:.1e}" if check else "HF check skipped"
    log(f"{model_dir}: {len(acts)} activations, {len(req.prompt_ids)} prefill tokens with an image of "
        f"{req.batch.num_tiles[0]} tiles + {DECODE_STEPS} decode steps; {hf}")
    return model_dir


def load_vision_golden(model_dir: Path) -> GoldenRecord:
    model_dir = Path(model_dir)
    path, hint = model_dir / MANIFEST, regenerate_hint(model_dir)
    manifest = read_json_object(path, "a golden manifest", GoldenError, hint)
    if manifest.get("format") != FORMAT or manifest.get("version") != FORMAT_VERSION:
        raise GoldenError(f"{path}: not a llama32 golden manifest of version {FORMAT_VERSION}; {hint}")
    cfg = MllamaConfig.from_file(model_dir / "config.json")
    if manifest.get("config_fingerprint") != cfg.fingerprint():
        raise GoldenError(f"{path}: recorded for config fingerprint {manifest.get('config_fingerprint')!r}, but "
                          f"{model_dir / 'config.json'} now gives {cfg.fingerprint()!r}; {hint}")
    if not (isinstance(manifest.get("prompt"), str) and isinstance(manifest.get("images"), list)
            and all(isinstance(n, str) and "/" not in n and "\\" not in n for n in manifest["images"])):
        raise GoldenError(f"{path}: a vision record needs 'prompt' (text) and 'images' (file names beside it); "
                          f"{hint}")
    steps = parse_steps(manifest, str(path))
    tensors = SafetensorsFile(model_dir / ACTIVATIONS)
    for key in [f"inputs/{k}" for k in INPUTS] + [f"{s.name}/{n}" for s in steps for n in step_names(cfg, s.name)]:
        if key not in tensors.tensors:
            raise GoldenError(f"{tensors.path}: missing tensor {key!r}; {hint}")
    return GoldenRecord(model_dir, manifest, steps, tensors)


def check_vision_golden(rec: GoldenRecord, ckpt, engine, dtype: str | None = None, keep=lambda key: True,
                        isolate: bool = False) -> tuple[list[Row], str]:
    """Rebuild the inputs from the image file and prompt, compare them with the recorded ones (ids exactly,
    pixels and mask as rows "inputs/..."), then every activation of every step, in forward order."""
    dtype = dtype or engine_dtype(engine)
    req = vision_request(ckpt, rec.manifest)
    if req.prompt_ids != rec.steps[0].ids:
        raise GoldenError(f"{rec.model_dir}: the prompt now tokenizes to {req.prompt_ids}, the record has "
                          f"{rec.steps[0].ids}; {regenerate_hint(rec.model_dir)}")
    rows = [Row("inputs", compare(k, np.asarray(getattr(req.images, k), np.float32), rec.tensors.load(f"inputs/{k}"),
                                  TOLERANCES["fp32"])) for k in INPUTS if keep(f"inputs/{k}")]
    cache = engine.new_cache(max(p for s in rec.steps for p in s.positions) + 1)
    for step in rec.steps:
        reference = ((name, rec.get(step.name, name)) for name in step_names(ckpt.config, step.name))
        inputs = {"images": req.images} if step.name == "prefill" else {}
        forward = engine.steps(step.ids, step.positions, cache, **inputs)
        rows += compare_rows(reference, engine, forward, TOLERANCES[dtype], keep, isolate, step.name)
    return rows, dtype
