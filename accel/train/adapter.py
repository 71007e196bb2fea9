"""Writing a PEFT LoRA adapter directory (reading goes through refimpl.formats.lora.load_lora, which validates).

adapter_config.json carries what `peft.LoraConfig` needs to rebuild the modules; adapter_model.safetensors holds
`base_model.model.<module>.lora_A.weight` [R, Din] and `.lora_B.weight` [Dout, R] in fp32, PEFT's own key names.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from refimpl.formats.safetensors_io import save_safetensors


def adapter_config(base_model: str, rank: int, alpha: float, dropout: float, targets: list[str],
                   use_rslora: bool = False, rank_pattern: dict | None = None,
                   alpha_pattern: dict | None = None) -> dict:
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": rank, "lora_alpha": alpha, "lora_dropout": dropout, "target_modules": sorted(targets),
        "use_rslora": use_rslora, "rank_pattern": rank_pattern or {}, "alpha_pattern": alpha_pattern or {},
        "bias": "none", "fan_in_fan_out": False, "use_dora": False, "init_lora_weights": True,
        "inference_mode": True, "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None,
    }


def save_adapter(out_dir: str | Path, modules: dict, config: dict) -> Path:
    """Write the adapter; files land under temporary names first, so an interrupted save never leaves half a file."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for m in modules.values():
        tensors[f"base_model.model.{m.name}.lora_A.weight"] = m.a.detach().float().cpu().numpy()
        tensors[f"base_model.model.{m.name}.lora_B.weight"] = m.b.detach().float().cpu().numpy()
    tmp = out / "adapter_model.safetensors.tmp"
    save_safetensors(tmp, tensors, dtype="F32", metadata={"format": "pt"})
    os.replace(tmp, out / "adapter_model.safetensors")
    tmp = out / "adapter_config.json.tmp"
    tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, out / "adapter_config.json")
    return out
