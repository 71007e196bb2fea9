"""One fine-tuning run put together: checkpoint + data + LoRA state -> a TrainModel, and saving its adapter.

`TrainSession.open` is the one path for every checkpoint; what depends on the model family (which linears may be
adapted and under which PEFT names, how a data line becomes a sample, the weights and the training forward) is a
`TextTraining` (accel.train.text_training), or for Llama 3.2 Vision its subclass
accel.train.vision_training.VisionTraining.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from accel.train.adapter import adapter_config, save_adapter
from accel.train.lora import from_adapter, init_lora
from accel.train.loop import TrainSettings, evaluate, plan_steps, train
from accel.train.model import TrainModel
from accel.train.text_training import TextTraining
from accel.train.vision_training import VisionTraining
from refimpl.errors import CheckpointError
from refimpl.formats.checkpoint import load_checkpoint
from refimpl.formats.jsonfile import read_json_object
from refimpl.formats.lora import load_lora
from refimpl.family import TEXT, VISION, family_of
from refimpl.train.data import load_samples

# what a run adapts and runs, per model family (refimpl.family): Llama 3.2 Vision's has image samples and LoRA on
# the text decoder
TRAINING = {TEXT.name: TextTraining, VISION.name: VisionTraining}


DEFAULT_DROPOUT = 0.05  # a fresh adapter's LoRA dropout


@dataclass(frozen=True)
class TrainSessionSettings:
    rank: int = 8
    alpha: float = 32.0
    dropout: float | None = None  # None: the init adapter's lora_dropout, else DEFAULT_DROPOUT
    targets: tuple[str, ...] = ("q_proj", "v_proj")
    max_length: int = 2048
    seed: int = 0
    init_adapter: Path | None = None
    compile: bool = False
    columns: dict | None = None  # the data's field names -> refimpl.train.data's (--columns)


class TrainSession:
    """A training forward with its LoRA state, the training and evaluation samples, the adapter config to save."""

    def __init__(self, model: TrainModel, samples, eval_samples, config: dict, device):
        self.model, self.samples, self.eval_samples, self.config, self.device = (model, samples, eval_samples,
                                                                                  config, device)

    @classmethod
    def open(cls, model_path: Path, data: Path, eval_data: Path | None, device, dtype: str,
             warn: Callable[[str], None], s: TrainSessionSettings) -> "TrainSession":
        ckpt = load_checkpoint(model_path)
        if ckpt.tokenizer is None:
            raise CheckpointError(f"{model_path}: has no tokenizer; training data cannot be rendered")
        family = TRAINING[family_of(ckpt.config).name](ckpt, Path(model_path))

        def load(path):
            return load_samples(path, ckpt.tokenizer, s.max_length, warn, family.record_encoder(Path(path)),
                                s.columns)

        samples = load(data)
        eval_samples = load(eval_data) if eval_data else []
        if s.init_adapter is not None:  # its own lora_dropout (PEFT reads it too) unless one is given
            lora, config = _from_init_adapter(s.init_adapter, family, str(model_path))
            s = replace(s, dropout=config["lora_dropout"] if s.dropout is None else s.dropout)
            config["lora_dropout"] = s.dropout
        else:
            s = replace(s, dropout=DEFAULT_DROPOUT if s.dropout is None else s.dropout)
            lora = init_lora(*family.fresh_targets(s.targets), s.rank, s.alpha / s.rank, s.seed, family.module_of)
            config = adapter_config(str(model_path), s.rank, s.alpha, s.dropout, list(s.targets))
        config["target_modules"] = family.target_modules({m.name for m in lora.values()}, config["target_modules"])
        for m in lora.values():
            m.a.data, m.b.data = m.a.data.to(device), m.b.data.to(device)
        weights = family.load_weights(ckpt.params, device, dtype)
        ckpt.params = None  # the fp32 host copy is no longer needed
        return cls(family.model(weights, lora, s.dropout, s.compile), samples, eval_samples, config, device)

    def planned_steps(self, settings: TrainSettings) -> int:
        return len(plan_steps(self.samples, settings))

    def train(self, settings: TrainSettings, out: Path, on_step) -> dict:
        def save(name):
            save_adapter(out if name is None else Path(out) / name, self.model.lora, self.config)
        return train(self.model, self.samples, settings, self.device, on_step, save)

    def evaluate(self, batch_size: int) -> float:
        return evaluate(self.model, self.eval_samples, batch_size, self.device)


def _from_init_adapter(adapter_dir: Path, family: TextTraining, base: str):
    """Trainable modules (keyed by checkpoint weight name) and the adapter config to write, from an existing PEFT
    adapter (validated for this base)."""
    adapter = load_lora(adapter_dir, family.cfg)
    family.refuse_untrainable(adapter, adapter_dir)
    d = read_json_object(Path(adapter_dir) / "adapter_config.json", "a PEFT adapter config")
    lora = from_adapter(adapter, family.module_of)
    targets = sorted({m.name.rsplit(".", 1)[-1] for m in lora.values()})
    config = adapter_config(base, int(d.get("r", 8)), d.get("lora_alpha", 8), float(d.get("lora_dropout", 0.0)),
                            targets, bool(d.get("use_rslora")), d.get("rank_pattern"), d.get("alpha_pattern"))
    return lora, config
