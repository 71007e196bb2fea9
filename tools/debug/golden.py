"""Golden activations: record every named activation of the reference once, check any backend against them later.

A golden record (tools/debug/golden_record.py) lives beside its toy checkpoint (golden/<toy>/). Here: the text
toys' records, and `make_golden`, which writes every toy's (the vision toy's through tools/debug/vision_golden.py).
Steps are a prefill over a chat prompt whose positions run past the toy's original_max_position_embeddings, then
greedy decode steps against the same KV cache. The comparison runs through the lockstep driver shared with
`llama32 diff` and `llama32 step` (tools/debug/lockstep.py), in forward order, so the first failing row is the first
op that diverged.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import numpy as np

from refimpl.compare import TOLERANCES, compare
from refimpl.model.config import LlamaConfig
from refimpl.errors import quote
from refimpl.formats.jsonfile import read_json_object
from refimpl.model.names import activation_names, split_name
from refimpl.formats.safetensors_io import SafetensorsFile, save_safetensors

from tools.debug.golden_record import (ACTIVATIONS, DECODE_STEPS, DEFAULT_DIR, FORMAT, FORMAT_VERSION, MANIFEST,
                                       GoldenError, GoldenRecord, Step, logits_check, parse_steps, record,
                                       regenerate_hint, tool_version)
from tools.debug.lockstep import Row, compare_rows, engine_dtype
from tools.debug.vision_golden import make_vision_golden

# 51 prefill tokens with the toy tokenizer: positions 0..52 over 2 decode steps, past original_max_position 32.
PROMPT = [{"role": "user", "content": "Write one line about the sea, its tides and the moon."}]


def activation_shapes(cfg: LlamaConfig, tokens: int) -> dict[str, tuple[int, ...]]:
    """The shape of every named activation for a forward over `tokens` tokens (all logits rows)."""
    T, D, F = tokens, cfg.hidden_size, cfg.intermediate_size
    H, K, E = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    per_kind = {"attn.q": (T, H, E), "attn.q_rot": (T, H, E), "attn.out": (T, H, E),
                "attn.k": (T, K, E), "attn.v": (T, K, E), "attn.k_rot": (T, K, E),
                "mlp.gate": (T, F), "mlp.up": (T, F), "mlp.act": (T, F), "logits": (T, cfg.vocab_size)}
    return {n: per_kind.get(split_name(n)[1], (T, D)) for n in activation_names(cfg.num_hidden_layers)}


def hf_check(model_dir: Path, steps: list[Step], acts: dict[str, np.ndarray]) -> dict | None:
    """Run HF transformers' LlamaForCausalLM over the whole sequence at once (no cache) and compare its logits
    with ours from the cached steps. None where torch/transformers are not installed."""
    try:
        import torch
        import transformers
    except ImportError:
        return None
    transformers.utils.logging.disable_progress_bar()
    model = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = [i for s in steps for i in s.ids]
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits[0].numpy()  # [T, V]
    return logits_check(theirs, steps, acts, transformers.__version__)


def make_golden(out_root: str | Path = DEFAULT_DIR, with_hf: bool = True, log: Callable = print) -> list[Path]:
    """Write every toy checkpoint and its golden record under out_root.

    Deterministic everywhere: the checkpoints (seeded PCG64 weights, tokenizer, configs) and the manifest.
    Deterministic on one machine only: the activations. Their last bits follow the BLAS kernels the CPU gets
    (OpenBLAS picks them per core type) and NumPy's SIMD paths, so another machine's records differ within the
    fp32 tolerance of refimpl/compare.py, which is how `golden check` and the tests compare them."""
    from refimpl.formats.checkpoint import load_checkpoint
    from refimpl.generate import RefEngine

    from tools.toy import TOYS, write_toy_checkpoint
    made = []
    for spec in TOYS:
        model_dir = write_toy_checkpoint(spec, out_root)
        ckpt = load_checkpoint(model_dir)
        prompt_ids = ckpt.tokenizer.encode_chat(PROMPT)
        steps, acts = record(RefEngine(ckpt), prompt_ids, DECODE_STEPS)
        save_safetensors(model_dir / ACTIVATIONS, acts, metadata={"format": FORMAT})
        check = hf_check(model_dir, steps, acts) if with_hf else None
        manifest = {"format": FORMAT, "version": FORMAT_VERSION, "tool": tool_version(), "model": spec.name,
                    "config_fingerprint": ckpt.config.fingerprint(), "dtype": "fp32", "backend": "refimpl",
                    "prompt": PROMPT, "steps": [s.__dict__ for s in steps], "activations": ACTIVATIONS,
                    "hf_check": check}
        (model_dir / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
        hf = f"HF logits max |diff| {check['max_abs_logits']:.1e}" if check else "HF check skipped"
        log(f"{model_dir}: {len(acts)} activations, {len(prompt_ids)} prefill tokens + {DECODE_STEPS} decode "
            f"steps (positions 0..{steps[-1].positions[-1]}); {hf}")
        made.append(model_dir)
    made.append(make_vision_golden(Path(out_root), with_hf, log))
    return made


# ---------------------------------------------------------------- loading and validation

def load_golden(model_dir: str | Path) -> GoldenRecord:
    """Read and validate a golden record against its checkpoint's config.json; raise GoldenError on any mismatch."""
    model_dir = Path(model_dir)
    path, hint = model_dir / MANIFEST, regenerate_hint(model_dir)
    manifest = read_json_object(path, "a golden manifest", GoldenError, hint)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else None
        raise GoldenError(f"{path}: not a llama32 golden manifest (format {got!r}, expected {FORMAT!r}); {hint}")
    if manifest.get("version") != FORMAT_VERSION:
        raise GoldenError(f"{path}: golden format version {manifest.get('version')!r}, but this llama32 reads "
                          f"version {FORMAT_VERSION}; {hint}")
    cfg = LlamaConfig.from_file(model_dir / "config.json")
    if manifest.get("config_fingerprint") != cfg.fingerprint():
        raise GoldenError(f"{path}: recorded for config fingerprint {manifest.get('config_fingerprint')!r}, but "
                          f"{model_dir / 'config.json'} now gives {cfg.fingerprint()!r}; {hint}")
    steps = parse_steps(manifest, str(path))
    for step in steps:
        bad = next((i for i in step.ids if not 0 <= i < cfg.vocab_size), None)
        if bad is not None:
            raise GoldenError(f"{path}: step {quote(step.name)} has token id {quote(bad)}, outside the vocabulary "
                              f"[0, {cfg.vocab_size}); {hint}")
        bad = next((p for p in step.positions if not 0 <= p < cfg.max_position_embeddings), None)
        if bad is not None:
            raise GoldenError(f"{path}: step {quote(step.name)} has position {quote(bad)}, outside [0, "
                              f"{cfg.max_position_embeddings}); {hint}")
    tensors = SafetensorsFile(model_dir / str(manifest.get("activations", ACTIVATIONS)))
    for step in steps:
        for name, shape in activation_shapes(cfg, len(step.ids)).items():
            key = f"{step.name}/{name}"
            if key not in tensors.tensors:
                raise GoldenError(f"{tensors.path}: missing tensor {key!r}; {hint}")
            if tensors.tensors[key].shape != shape:
                raise GoldenError(f"{tensors.path}: tensor {key!r} has shape {list(tensors.tensors[key].shape)}, "
                                  f"but config.json and the {len(step.ids)} recorded tokens imply {list(shape)}; "
                                  f"{hint}")
    return GoldenRecord(model_dir, manifest, steps, tensors)


# ---------------------------------------------------------------- checking, op by op

def check_golden_logits(rec: GoldenRecord, engine) -> tuple[list[Row], str]:
    """A tensor-parallel engine (accel.tp) against the record: each step's last-token logits, the only activation
    a rank holds whole (the rest are its slices), on a fresh cache; the engine's dtype's tolerance."""
    engine.new_cache(max(p for s in rec.steps for p in s.positions) + 1)
    rows = []
    for step in rec.steps:
        got = engine.logits(step.ids, step.positions[0]).float().cpu().numpy()  # [1, V]
        rows.append(Row(step.name, compare("logits", got, rec.get(step.name, "logits")[-1:],
                                           TOLERANCES[engine.dtype_name])))
    return rows, engine.dtype_name


def check_golden(rec: GoldenRecord, engine, dtype: str | None = None, keep=lambda key: True,
                 isolate: bool = False) -> tuple[list[Row], str]:
    """Run the recorded steps on a fresh cache; returns (rows in forward order, dtype whose tolerance applied).
    dtype None: the engine's own."""
    dtype = dtype or engine_dtype(engine)
    cache = engine.new_cache(max(p for s in rec.steps for p in s.positions) + 1)
    names = activation_names(engine.config.num_hidden_layers)
    rows = []
    for step in rec.steps:
        reference = ((name, rec.get(step.name, name)) for name in names)
        forward = engine.steps(step.ids, step.positions, cache)
        rows += compare_rows(reference, engine, forward, TOLERANCES[dtype], keep, isolate, step.name)
    return rows, dtype
