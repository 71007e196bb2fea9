"""PEFT LoRA module names of HF's LlamaForCausalLM (a Llama text base), and the parameters they adapt: the decoder
layers' linears (`model.layers.3.self_attn.q_proj`) and, unless tied to the embedding, `lm_head`.
"""
from __future__ import annotations

import re
from pathlib import Path

from refimpl.errors import CheckpointError, quote
from refimpl.formats.lora_targets import LLAMA_LINEARS, BoundedMatcher, targeted_modules
from refimpl.formats.params import expected_shapes
from refimpl.model.config import LlamaConfig

_LAYER_MODULE_RE = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)$")


def text_lora_param(module: str, how: str, cfg: LlamaConfig, path: Path) -> str:
    """PEFT module name -> the checkpoint parameter it adapts, refusing anything but Llama's linears.
    `how` says where the module came from ("a tensor adapts", "target_modules selects")."""
    m = _LAYER_MODULE_RE.match(module)
    if m and m.group(3) in LLAMA_LINEARS:
        name = module + ".weight"
    elif module == "lm_head" and not cfg.tie_word_embeddings:
        name = "lm_head.weight"
    else:
        raise CheckpointError(f"{path}: {how} module {quote(module)}; only the Llama linears "
                              f"({', '.join(LLAMA_LINEARS)}{', lm_head' if not cfg.tie_word_embeddings else ''}) "
                              f"are supported")
    if name not in expected_shapes(cfg):
        raise CheckpointError(f"{path}: LoRA matrices for {quote(name)}, which this base model does not have "
                              f"(an adapter for another base? config has {cfg.num_hidden_layers} layers)")
    return name


def text_lora_targets(d: dict, cfg: LlamaConfig, path: Path, matcher: BoundedMatcher) -> list[str]:
    """The module names adapter config `d` adapts in this base, as PEFT decides."""
    return targeted_modules(d, cfg.num_hidden_layers, path, matcher)
