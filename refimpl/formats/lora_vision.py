"""PEFT LoRA module names of HF's MllamaForConditionalGeneration (Llama 3.2 Vision), and the parameters they adapt.

PEFT names a module by its path in the model it wraps: transformers 5 builds `model.language_model.layers.3.
cross_attn.q_proj`, `model.vision_model.transformer.layers.0.mlp.fc1`, `model.multi_modal_projector`, `lm_head`
(older versions' `language_model.model.layers.3...` is read too). Every nn.Linear of the model can carry a LoRA
pair that merges as W + scale · B @ A: the text decoder's, the vision tower's, the projector and the lm_head.
"""
from __future__ import annotations

from pathlib import Path

from refimpl.errors import CheckpointError, quote
from refimpl.formats.lora_targets import BoundedMatcher, targeted_modules
from refimpl.formats.vision_checkpoint import expected_vision_shapes, hub_name, transformers_name
from refimpl.model.vision_config import MllamaConfig

TEXT_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# the leaf names PEFT's "all-linear" expands to on Mllama (every nn.Linear but the output layer lm_head)
ALL_LINEAR_LEAVES = TEXT_LINEARS + ("fc1", "fc2", "multi_modal_projector")
TEXT_LAYERS = "language_model.model.layers."  # Hub prefix of the text decoder's layers


def param_of(module: str) -> str:
    """PEFT module name (either transformers scheme) -> the Hub name of the weight it adapts."""
    return hub_name(module + ".weight")


def module_of(param: str) -> str:
    """Hub weight name -> the module name transformers 5 (and so PEFT) gives it."""
    return transformers_name(param).removesuffix(".weight")


def linear_params(cfg: MllamaConfig) -> dict[str, tuple[int, int]]:
    """Hub name -> [Dout, Din] of every weight a LoRA pair may adapt (the model's nn.Linear layers)."""
    return {name: shape for name, shape in expected_vision_shapes(cfg).items()
            if name.endswith(".weight") and len(shape) == 2
            and name.removesuffix(".weight").rsplit(".", 1)[-1] in ALL_LINEAR_LEAVES + ("lm_head",)}


def vision_modules(cfg: MllamaConfig) -> list[str]:
    """Module names of MllamaForConditionalGeneration in transformers 5's scheme: every module holding a
    parameter and every container above one (what PEFT's target matching walks)."""
    names: dict[str, None] = {}
    for param in expected_vision_shapes(cfg):
        parts = transformers_name(param).split(".")[:-1]
        for n in range(1, len(parts) + 1):
            names[".".join(parts[:n])] = None
    return list(names)


def text_param(layer: int, cfg: MllamaConfig, linear: str) -> str:
    """(3, cfg, 'q_proj') -> 'language_model.model.layers.3.cross_attn.q_proj.weight' (self_attn / mlp as fits)."""
    kind = "mlp" if linear in TEXT_LINEARS[4:] else (
        "cross_attn" if layer in cfg.text.cross_attention_layers else "self_attn")
    return f"{TEXT_LAYERS}{layer}.{kind}.{linear}.weight"


def text_target_regex(linears) -> str:
    """target_modules for PEFT that adapts the named linears of the text decoder only (self- and
    cross-attention layers alike), never the vision tower's q/k/v/o_proj of the same short names."""
    return rf".*language_model\.(model\.)?layers\.\d+\.(self_attn|cross_attn|mlp)\.({'|'.join(linears)})"


def vision_lora_param(module: str, how: str, cfg: MllamaConfig, path: Path) -> str:
    """PEFT module name -> the Hub name of the weight it adapts, refusing anything but the model's linears.
    `how` says where the module came from ("a tensor adapts", "target_modules selects")."""
    name = param_of(module)
    if name not in linear_params(cfg):
        known = module_of(name) in vision_modules(cfg)
        raise CheckpointError(f"{path}: {how} module {quote(module)}, " + (
            "which is not a linear layer; only the linears of the text decoder, vision tower, projector and "
            "lm_head are supported" if known else
            f"which this base model does not have (an adapter for another base? config has "
            f"{cfg.text.num_hidden_layers} text layers)"))
    return name


def vision_lora_targets(d: dict, cfg: MllamaConfig, path: Path, matcher: BoundedMatcher) -> list[str]:
    """The module names adapter config `d` adapts in this base, as PEFT decides (among every module of
    MllamaForConditionalGeneration; "all-linear" expands to ALL_LINEAR_LEAVES)."""
    return targeted_modules(d, cfg.num_hidden_layers, path, matcher, modules=vision_modules(cfg),
                            all_linear=ALL_LINEAR_LEAVES)
