"""PEFT LoRA adapters: read a `save_pretrained` directory and merge it into the base weights (fp32).

An adapter directory holds adapter_config.json and adapter_model.safetensors with keys such as
`base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight` ([R, Din]) and `...lora_B.weight` ([Dout, R]).
Merged weight = W + scale · (B @ A) with scale = alpha / r, or alpha / sqrt(r) with use_rslora; `rank_pattern`
and `alpha_pattern` override r and alpha per module, matched as PEFT matches them (`get_pattern_key`: the first
pattern p, in file order, for which `(.*\\.)?(p)$` matches the module name).

Which modules an adapter may name and the weights they adapt depend on the model family (refimpl.family): a Llama
text base's decoder linears and lm_head (refimpl.formats.lora_text), or any linear of a Llama 3.2 Vision base (text
decoder, vision tower, projector, lm_head; refimpl.formats.lora_vision), whose parameters come back in the Hub's
names.

Only what merges into plain Llama linears is accepted; every other PEFT feature is refused by name rather than
silently merged wrong (DoRA rescales columns, lora_bias adds a bias Llama lacks, fan_in_fan_out transposes).
"""
from __future__ import annotations

import math
import re
import stat
import sys
from pathlib import Path

import numpy as np

from refimpl.errors import CheckpointError, quote
from refimpl.family import family_of
from refimpl.formats.jsonfile import read_json_object
from refimpl.formats.lora_targets import BoundedMatcher
from refimpl.formats.safe_open import check_path, stat_path
from refimpl.formats.safetensors_io import SafetensorsFile
from refimpl.model import ops
from refimpl.model.config import LlamaConfig
from refimpl.model.llama import LoraWeight

_KEY_RE = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")
# PEFT's save_embedding_layers="auto" also stores the full base weight of an adapted lm_head / embedding
_BASE_LAYER_RE = re.compile(r"^base_model\.model\.(?P<module>.+)\.base_layer\.weight$")

Adapter = list  # [(param name, lora_a [R, Din], lora_b [Dout, R], scale)]


def _read_config(adapter_dir: Path) -> dict:
    path = adapter_dir / "adapter_config.json"
    st = stat_path(check_path(adapter_dir, "--lora"))
    if st is None or not stat.S_ISDIR(st.st_mode):
        raise CheckpointError(f"{adapter_dir}: --lora expects a PEFT adapter directory (with adapter_config.json)")
    return read_json_object(path, "a PEFT adapter directory needs adapter_config.json")


def _check_supported(d: dict, path: Path) -> None:
    """Refuse every adapter kind whose merge is not W + scale · B @ A on a Llama linear."""
    peft_type = d.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise CheckpointError(f"{path}: peft_type {peft_type!r} is not supported (expected 'LORA')")
    refusals = {
        "use_dora": "DoRA adapters (use_dora) are not supported",
        "fan_in_fan_out": "fan_in_fan_out adapters (GPT-2 style Conv1D) are not supported",
        "lora_bias": "lora_bias adapters are not supported (Llama linears have no bias)",
        "modules_to_save": "modules_to_save is not supported (only LoRA matrices are merged)",
        "trainable_token_indices": "trainable_token_indices is not supported",
    }
    for key, msg in refusals.items():
        if d.get(key):
            raise CheckpointError(f"{path}: {msg}, got {key}={d[key]!r}")
    bias = d.get("bias", "none")
    if bias != "none":
        raise CheckpointError(f"{path}: bias={bias!r} is not supported (expected 'none')")


def _number(value, what: str, path: Path, integer: bool = False):
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    if integer:
        ok = ok and float(value).is_integer()
    if not ok:
        raise CheckpointError(f"{path}: {what} must be a positive {'integer' if integer else 'number'}, "
                              f"got {value!r}")
    return int(value) if integer else float(value)


def _pattern_value(patterns: dict, module: str, default, what: str, matcher: BoundedMatcher):
    """PEFT's get_pattern_key: the first pattern (in file order) matching the end of the module name."""
    for pattern, value in patterns.items():
        if matcher.match(rf"(.*\.)?({pattern})$", module, f"{what} key", pattern):
            return value
    return default


def module_scale(d: dict, module: str, path: Path, matcher: BoundedMatcher | None = None) -> tuple[int, float]:
    """(rank, scale) PEFT gives `module` (e.g. 'model.layers.0.self_attn.q_proj') under adapter config `d`."""
    matcher = matcher or BoundedMatcher(path)
    r = _number(d.get("r", 8), "r", path, integer=True)
    alpha = _number(d.get("lora_alpha", 8), "lora_alpha", path)
    rank_pattern, alpha_pattern = d.get("rank_pattern") or {}, d.get("alpha_pattern") or {}
    if not isinstance(rank_pattern, dict) or not isinstance(alpha_pattern, dict):
        raise CheckpointError(f"{path}: rank_pattern and alpha_pattern must be objects of pattern -> value")
    r = _number(_pattern_value(rank_pattern, module, r, "rank_pattern", matcher), f"rank_pattern for {module}",
                path, integer=True)
    alpha = _number(_pattern_value(alpha_pattern, module, alpha, "alpha_pattern", matcher),
                    f"alpha_pattern for {module}", path)
    return r, (alpha / math.sqrt(r) if d.get("use_rslora") else alpha / r)


def _param_name(module: str, how: str, cfg, path: Path) -> str:
    """PEFT module name -> the checkpoint parameter it adapts, refusing anything but the family's linears.
    `how` says where the module came from ("a tensor adapts", "target_modules selects")."""
    return family_of(cfg).lora_param(module, how, cfg, path)


def _weights_file(adapter_dir: Path) -> Path:
    path = adapter_dir / "adapter_model.safetensors"
    if stat_path(path) is None:
        pickled = stat_path(adapter_dir / "adapter_model.bin") is not None
        hint = " (adapter_model.bin is a pickle, which llama32 never loads: re-save with safe_serialization)" \
            if pickled else ""
        raise CheckpointError(f"{path}: not found{hint}")
    return path


def load_lora(adapter_dir: str | Path, cfg: LlamaConfig) -> Adapter:
    """Read a PEFT LoRA adapter -> [(param name, lora_a [R, Din], lora_b [Dout, R], scale)], shapes checked."""
    adapter_dir = Path(adapter_dir)
    d = _read_config(adapter_dir)
    cfg_path = adapter_dir / "adapter_config.json"
    _check_supported(d, cfg_path)
    weights = _weights_file(adapter_dir)
    st = SafetensorsFile(weights)
    pairs: dict[str, dict[str, str]] = {}
    shapes = family_of(cfg).expected_shapes(cfg)
    for key in st.names():
        m = _KEY_RE.match(key)
        base = _BASE_LAYER_RE.match(key)
        if base:  # a copy of the base weight: fine if it is this base's shape (a resized vocab is another base)
            name = _param_name(base.group("module"), "a base_layer tensor copies", cfg, weights)
            if st.tensors[key].shape != shapes[name]:
                raise CheckpointError(f"{weights}: {key} has shape {list(st.tensors[key].shape)}, but the base "
                                      f"model's {name} is {list(shapes[name])} (an adapter for another base?)")
            continue
        if not m:
            raise CheckpointError(f"{weights}: tensor {quote(key)} is not a LoRA matrix "
                                  f"(expected base_model.model.<module>.lora_A/lora_B.weight)")
        pairs.setdefault(m.group("module"), {})[m.group("ab")] = key
    if not pairs:
        raise CheckpointError(f"{weights}: holds no LoRA matrices")
    for module, ab in pairs.items():  # a matrix for a module this base lacks or llama32 cannot merge: refused
        _param_name(module, "a tensor adapts", cfg, weights)
    matcher = BoundedMatcher(cfg_path)  # one matching budget for the whole adapter
    targeted = family_of(cfg).lora_targets(d, cfg, cfg_path, matcher)
    for module in targeted:  # PEFT raises on a targeted module it cannot adapt; llama32 merges only linears
        _param_name(module, "target_modules selects", cfg, cfg_path)
    skipped = [module for module in pairs if module not in set(targeted)]
    if skipped:  # PEFT loads only what the config targets and ignores the rest of the file
        print(f"warning: {weights}: ignoring LoRA matrices of {len(skipped)} module(s) the config does not target "
              f"(as PEFT does), e.g. {quote(skipped[0])}", file=sys.stderr)
    adapter = []
    for module, ab in pairs.items():
        if module in skipped:
            continue
        if set(ab) != {"A", "B"}:
            missing = "lora_B" if "A" in ab else "lora_A"
            raise CheckpointError(f"{weights}: module {module!r} has no {missing} matrix")
        name = _param_name(module, "a tensor adapts", cfg, weights)
        rank, scale = module_scale(d, module, cfg_path, matcher)
        d_out, d_in = shapes[name]
        a_shape, b_shape = st.tensors[ab["A"]].shape, st.tensors[ab["B"]].shape
        if a_shape != (rank, d_in) or b_shape != (d_out, rank):
            raise CheckpointError(f"{weights}: {module} has lora_A {list(a_shape)} and lora_B {list(b_shape)}, "
                                  f"expected [{rank}, {d_in}] and [{d_out}, {rank}] for this base model and "
                                  f"rank {rank} (an adapter for another base?)")
        adapter.append((name, np.asarray(st.load(ab["A"]), np.float32), np.asarray(st.load(ab["B"]), np.float32),
                        scale))
    return adapter


def merge_lora(params: dict, cfg: LlamaConfig, adapter: Adapter) -> dict:
    """A new params dict with every adapted weight replaced by W + scale · B @ A (fp32); others shared."""
    merged = dict(params)
    for name, lora_a, lora_b, scale in adapter:
        merged[name] = ops.lora_merge(np.asarray(merged[name], np.float32), lora_a, lora_b, scale)  # [Dout, Din]
    return merged


def attach_lora(params: dict, adapter: Adapter) -> dict:
    """A new params dict serving the adapter unmerged: each adapted weight becomes a LoraWeight; base untouched."""
    attached = dict(params)
    for name, lora_a, lora_b, scale in adapter:
        attached[name] = LoraWeight(params[name], lora_a, lora_b, scale)
    return attached
