"""What a fine-tuning run on a Llama text checkpoint adapts and runs (accel.train.session.TrainSession.open runs
it): the decoder layers' linears under their checkpoint names, text conversations, TrainModel. Llama 3.2 Vision's
run changes some of it (accel.train.vision_training.VisionTraining).
"""
from __future__ import annotations

from pathlib import Path

from accel.train.lora import module_name, target_names
from accel.train.model import TrainModel
from accel.weights import DTYPES, load_weights
from refimpl.errors import CheckpointError
from refimpl.formats.params import expected_shapes


class TextTraining:
    """What a fine-tuning run on a Llama text checkpoint adapts and runs: the decoder layers' linears, named by
    their checkpoint weights (`model.layers.3.self_attn.q_proj`), text conversations, TrainModel."""

    def __init__(self, ckpt, model_path: Path):
        self.cfg, self.tokenizer = ckpt.config, ckpt.tokenizer

    def record_encoder(self, data_path: Path):
        """load_samples' `encode_record` for a data file (None: the text path's own)."""
        return None

    def refuse_untrainable(self, adapter, adapter_dir: Path) -> None:
        """An existing adapter (load_lora's list) may adapt only the linears training reaches."""
        lm_head = [name for name, *_ in adapter if not name.startswith("model.layers.")]
        if lm_head:
            raise CheckpointError(f"{adapter_dir}: adapts {lm_head[0]!r}; training supports the decoder layers' "
                                  f"linears only")

    def fresh_targets(self, targets: tuple[str, ...]) -> tuple[dict, list[str]]:
        """(checkpoint name -> [Dout, Din] of the adaptable weights, the names `targets` (short names) selects)."""
        return expected_shapes(self.cfg), target_names(self.cfg, targets)

    def module_of(self, param: str) -> str:
        """Checkpoint weight name -> the PEFT module name the adapter file uses."""
        return module_name(param)

    def target_modules(self, modules: set[str], targets: list[str]):
        """adapter_config.json's target_modules for the adapted `modules`, given their short names `targets`."""
        return targets

    def load_weights(self, params: dict, device, dtype: str):
        return load_weights(params, self.cfg, device, DTYPES[dtype])

    def model(self, weights, lora: dict, dropout: float, compile: bool) -> TrainModel:
        """The training forward; `lora` keyed by checkpoint weight name."""
        return TrainModel(weights, self.cfg, lora, dropout, compile=compile)
