"""What a fine-tuning run on a Llama 3.2 Vision checkpoint changes (accel.train.session.TrainSession.open runs
it): image samples, LoRA on the text decoder, the vision tower frozen.

Default targets: every linear of the text decoder (self- and cross-attention layers and all MLPs). PEFT's own
"all-linear" would also adapt the vision tower and the projector, so adapter_config.json names the modules with a
regex over the text decoder (or, for a set no such regex describes exactly, the full module names): loaded with
`peft.PeftModel.from_pretrained` on MllamaForConditionalGeneration it adapts exactly the trained modules.
"""
from __future__ import annotations

from pathlib import Path

from accel.train.vision_model import VisionTrainModel, trainer_key
from accel.train.text_training import TextTraining
from accel.vision.weights import load_vision_weights
from accel.weights import DTYPES
from refimpl.errors import CheckpointError
from refimpl.formats.lora_vision import (TEXT_LAYERS, TEXT_LINEARS, linear_params, module_of, text_param,
                                         text_target_regex)
from refimpl.train.image_data import VisionData, image_record_encoder


def target_modules(cfg, modules: set[str]) -> str | list[str]:
    """adapter_config.json's target_modules adapting exactly `modules` (PEFT names) in MllamaForConditionalGeneration:
    the text-decoder regex of their short names when it selects exactly them, else their full names."""
    shorts = [t for t in TEXT_LINEARS if any(m.endswith("." + t) for m in modules)]
    by_regex = {module_of(text_param(i, cfg, t)) for i in range(cfg.text.num_hidden_layers) for t in shorts}
    return text_target_regex(shorts) if by_regex == modules else sorted(modules)


class VisionTraining(TextTraining):
    """The text decoder's linears of a vision checkpoint (Hub weight names, transformers 5's module names), image
    conversations through the checkpoint's processor, VisionTrainModel."""

    def __init__(self, ckpt, model_path: Path):
        super().__init__(ckpt, model_path)
        self.vision_data = VisionData.for_checkpoint(model_path, self.cfg, self.tokenizer)

    def record_encoder(self, data_path: Path):
        return image_record_encoder(data_path, self.tokenizer, self.vision_data)

    def refuse_untrainable(self, adapter, adapter_dir: Path) -> None:
        outside = [name for name, *_ in adapter if not name.startswith(TEXT_LAYERS)]
        if outside:
            raise CheckpointError(f"{adapter_dir}: adapts {module_of(outside[0])!r}; training adapts the text "
                                  f"decoder's linears only (the vision encoder and projector stay frozen)")

    def fresh_targets(self, targets: tuple[str, ...]) -> tuple[dict, list[str]]:
        names = [text_param(i, self.cfg, t) for i in range(self.cfg.text.num_hidden_layers) for t in TEXT_LINEARS
                 if t in targets]
        return linear_params(self.cfg), names

    def module_of(self, param: str) -> str:
        return module_of(param)

    def target_modules(self, modules: set[str], targets: list[str]):
        return target_modules(self.cfg, modules)

    def load_weights(self, params: dict, device, dtype: str):
        return load_vision_weights(params, self.cfg, device, DTYPES[dtype])

    def model(self, weights, lora: dict, dropout: float, compile: bool) -> VisionTrainModel:
        return VisionTrainModel(weights, self.cfg, {trainer_key(self.cfg, name): m for name, m in lora.items()},
                                self.vision_data, dropout, compile=compile)
