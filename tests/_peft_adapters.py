"""PEFT LoRA adapters for a toy checkpoint, saved as PEFT saves them, with B drawn non-zero (PEFT starts B at zero,
and an adapter that changes nothing tests nothing)."""
from __future__ import annotations

from pathlib import Path

import pytest


def make_adapters(model_dir: Path, out_dir: Path, targets: dict[str, list[str]]) -> dict[str, Path]:
    """{name: target modules} -> {name: adapter directory}, adapter i drawn with seed i."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    dirs = {}
    for seed, (name, modules) in enumerate(targets.items()):
        base = transformers.LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
        model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=modules,
                                                          lora_dropout=0.0))
        torch.manual_seed(seed)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "lora_B" in pname:
                    p.normal_(0.0, 2.0)
        dirs[name] = Path(out_dir) / name
        model.save_pretrained(dirs[name])
    return dirs
