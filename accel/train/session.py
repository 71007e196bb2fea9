"""One fine-tuning run put together: checkpoint + data + LoRA state -> a TrainModel, and saving its adapter."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from accel.train.adapter import adapter_config, save_adapter
from accel.train.lora import from_adapter, init_lora, target_names
from accel.train.loop import TrainSettings, evaluate, plan_steps, train
from accel.train.model import TrainModel
from accel.weights import DTYPES, load_weights
from refimpl.errors import CheckpointError
from refimpl.formats.checkpoint import load_checkpoint
from refimpl.formats.jsonfile import read_json_object
from refimpl.formats.lora import load_lora
from refimpl.formats.params import expected_shapes
from refimpl.model.mllama_config import is_mllama
from refimpl.train.data import load_samples


@dataclass(frozen=True)
class SessionSettings:
    rank: int = 8
    alpha: float = 32.0
    dropout: float = 0.05
    targets: tuple[str, ...] = ("q_proj", "v_proj")
    max_length: int = 2048
    seed: int = 0
    init_adapter: Path | None = None
    compile: bool = False


class Session:
    def __init__(self, model: TrainModel, samples, eval_samples, config: dict, device):
        self.model, self.samples, self.eval_samples, self.config, self.device = (model, samples, eval_samples,
                                                                                  config, device)

    @classmethod
    def open(cls, model_path: Path, data: Path, eval_data: Path | None, device, dtype: str,
             warn: Callable[[str], None], s: SessionSettings) -> "Session":
        ckpt = load_checkpoint(model_path)
        cfg = ckpt.config
        if ckpt.tokenizer is None:
            raise CheckpointError(f"{model_path}: has no tokenizer; training data cannot be rendered")
        if is_mllama(cfg):  # Llama 3.2 Vision: image samples, LoRA on the text decoder
            from accel.train.mllama_session import open_mllama
            return cls(*open_mllama(ckpt, Path(model_path), data, eval_data, device, dtype, warn, s))
        samples = load_samples(data, ckpt.tokenizer, s.max_length, warn)
        eval_samples = load_samples(eval_data, ckpt.tokenizer, s.max_length, warn) if eval_data else []
        if s.init_adapter is not None:
            lora, config = _from_init_adapter(s.init_adapter, cfg, str(model_path))
            config["lora_dropout"] = s.dropout
        else:
            scale = s.alpha / s.rank
            lora = init_lora(expected_shapes(cfg), target_names(cfg, s.targets), s.rank, scale, s.seed)
            config = adapter_config(str(model_path), s.rank, s.alpha, s.dropout, list(s.targets))
        for m in lora.values():
            m.a.data, m.b.data = m.a.data.to(device), m.b.data.to(device)
        weights = load_weights(ckpt.params, cfg, device, DTYPES[dtype])
        ckpt.params = None  # the fp32 host copy is no longer needed
        return cls(TrainModel(weights, cfg, lora, s.dropout, compile=s.compile), samples, eval_samples, config, device)

    def planned_steps(self, settings: TrainSettings) -> int:
        return len(plan_steps(self.samples, settings))

    def train(self, settings: TrainSettings, out: Path, on_step) -> dict:
        def save(name):
            save_adapter(out if name is None else Path(out) / name, self.model.lora, self.config)
        return train(self.model, self.samples, settings, self.device, on_step, save)

    def evaluate(self, batch_size: int) -> float:
        return evaluate(self.model, self.eval_samples, batch_size, self.device)


def _from_init_adapter(adapter_dir: Path, cfg, base: str):
    """Trainable modules and the adapter config to write, from an existing PEFT adapter (validated for this base)."""
    adapter = load_lora(adapter_dir, cfg)
    lm_head = [name for name, *_ in adapter if not name.startswith("model.layers.")]
    if lm_head:
        raise CheckpointError(f"{adapter_dir}: adapts {lm_head[0]!r}; training supports the decoder layers' "
                              f"linears only")
    d = read_json_object(Path(adapter_dir) / "adapter_config.json", "a PEFT adapter config")
    targets = sorted({name.split(".")[-2] for name, *_ in adapter})
    config = adapter_config(base, int(d.get("r", 8)), d.get("lora_alpha", 8), float(d.get("lora_dropout", 0.0)),
                            targets, bool(d.get("use_rslora")), d.get("rank_pattern"), d.get("alpha_pattern"))
    return from_adapter(adapter), config
