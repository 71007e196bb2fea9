"""A fine-tuning run on a Llama 3.2 Vision checkpoint: image samples, LoRA on the text decoder, the vision tower frozen.

Default targets: every linear of the text decoder (self- and cross-attention layers and all MLPs). PEFT's own
"all-linear" would also adapt the vision tower and the projector, so adapter_config.json names the modules with a
regex over the text decoder (or, for a set no such regex describes exactly, the full module names): loaded with
`peft.PeftModel.from_pretrained` on MllamaForConditionalGeneration it adapts exactly the trained modules.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

from accel.train.adapter import adapter_config
from accel.train.lora import from_adapter, init_lora
from accel.train.mllama_model import MllamaTrainModel, trainer_key
from accel.vision.weights import load_mllama_weights
from accel.weights import DTYPES
from refimpl.errors import CheckpointError
from refimpl.formats.jsonfile import read_json_object
from refimpl.formats.lora import load_lora
from refimpl.formats.lora_mllama import (TEXT_LAYERS, TEXT_LINEARS, linear_params, module_of, text_param,
                                         text_target_regex)
from refimpl.train.data import load_samples
from refimpl.train.image_data import VisionData, image_record_encoder


def target_modules(cfg, modules: set[str]) -> str | list[str]:
    """adapter_config.json's target_modules adapting exactly `modules` (PEFT names) in MllamaForConditionalGeneration:
    the text-decoder regex of their short names when it selects exactly them, else their full names."""
    shorts = [t for t in TEXT_LINEARS if any(m.endswith("." + t) for m in modules)]
    by_regex = {module_of(text_param(i, cfg, t)) for i in range(cfg.text.num_hidden_layers) for t in shorts}
    return text_target_regex(shorts) if by_regex == modules else sorted(modules)


def _from_init_adapter(adapter_dir: Path, cfg, base: str):
    """Trainable modules (keyed by Hub name) and the adapter config to write, from an existing PEFT adapter."""
    adapter = load_lora(adapter_dir, cfg)
    outside = [name for name, *_ in adapter if not name.startswith(TEXT_LAYERS)]
    if outside:
        raise CheckpointError(f"{adapter_dir}: adapts {module_of(outside[0])!r}; training adapts the text decoder's "
                              f"linears only (the vision encoder and projector stay frozen)")
    d = read_json_object(Path(adapter_dir) / "adapter_config.json", "a PEFT adapter config")
    config = adapter_config(base, int(d.get("r", 8)), d.get("lora_alpha", 8), float(d.get("lora_dropout", 0.0)),
                            [], bool(d.get("use_rslora")), d.get("rank_pattern"), d.get("alpha_pattern"))
    lora = {name: dataclasses.replace(m, name=module_of(name)) for name, m in from_adapter(adapter).items()}
    return lora, config


def open_mllama(ckpt, model_path: Path, data: Path, eval_data: Path | None, device, dtype: str,
                warn: Callable[[str], None], s) -> tuple:
    """Session's constructor arguments (model, samples, eval samples, adapter config, device) for a vision
    checkpoint; `s` is a SessionSettings."""
    cfg, tok = ckpt.config, ckpt.tokenizer
    vd = VisionData.for_checkpoint(model_path, cfg, tok)

    def load(path):
        return load_samples(path, tok, s.max_length, warn, image_record_encoder(Path(path), tok, vd))

    samples = load(data)
    eval_samples = load(eval_data) if eval_data else []
    if s.init_adapter is not None:
        lora, config = _from_init_adapter(s.init_adapter, cfg, str(model_path))
        config["lora_dropout"] = s.dropout
    else:
        names = [text_param(i, cfg, t) for i in range(cfg.text.num_hidden_layers) for t in TEXT_LINEARS
                 if t in s.targets]
        fresh = init_lora(linear_params(cfg), names, s.rank, s.alpha / s.rank, s.seed)
        lora = {name: dataclasses.replace(m, name=module_of(name)) for name, m in fresh.items()}
        config = adapter_config(str(model_path), s.rank, s.alpha, s.dropout, [])
    config["target_modules"] = target_modules(cfg, {m.name for m in lora.values()})
    for m in lora.values():
        m.a.data, m.b.data = m.a.data.to(device), m.b.data.to(device)
    weights = load_mllama_weights(ckpt.params, cfg, device, DTYPES[dtype])
    ckpt.params = None  # the fp32 host copy is no longer needed
    model = MllamaTrainModel(weights, cfg, {trainer_key(cfg, name): m for name, m in lora.items()}, vd, s.dropout,
                             compile=s.compile)
    return model, samples, eval_samples, config, device
