"""Loading one rank's shard of a checkpoint directory, slice by slice.

Each tensor's slice (accel.tp.shard.ShardPlan.slice_of) is read from the safetensors file on its own
(refimpl.formats.safetensors_io.SafetensorsFile.load_slice: the slice's bytes only, never the whole tensor, never a
memory map), widened to float32, copied to the device in the run's dtype and dropped; so a rank's host memory peaks
near its own shard (on CPU, where the shard lives) plus one slice. Then fused as accel.weights fuses the whole
model: qkv = [q; k; v] and gate_up = [gate; up] of this rank's rows.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from refimpl.errors import CheckpointError
from refimpl.formats.checkpoint import assemble
from refimpl.formats.jsonfile import read_config_json
from refimpl.formats.params import Checkpoint, check_params
from refimpl.formats.safe_open import stat_path
from refimpl.formats.shards import read_headers
from refimpl.model.config import LlamaConfig

from ..weights import LayerWeights, Weights, host_tensor
from .shard import ShardPlan, check_divisible


def open_text_checkpoint(path: Path, with_tokenizer: bool = True, world: int = 1) -> Checkpoint:
    """A text checkpoint directory's config, tokenizer and stop ids, with no weights read (params empty): what the
    rank owning the CLI needs besides its shard. A GGUF file, a quantized or a vision checkpoint is refused, and a
    model `world` ranks cannot split (accel.tp.shard.check_divisible) before the tokenizer is read."""
    path = Path(path)
    st = stat_path(path, "expected a model directory")
    if st is None or not path.is_dir():
        raise CheckpointError(f"{path}: --tp > 1 loads a model directory (config.json + safetensors) shard by "
                              f"shard; GGUF files are not sharded yet")
    config = read_config_json(path / "config.json")
    if "quantization_config" in config:
        raise CheckpointError(f"{path}: --tp > 1 runs float checkpoints only for now; this one is quantized")
    if config.get("model_type") == "mllama":
        raise CheckpointError(f"{path}: --tp > 1 runs text models only for now; this is a Llama 3.2 Vision model")
    cfg = LlamaConfig.from_hf(config, source=str(path / "config.json"))
    check_divisible(cfg, world)
    return assemble(path, cfg, {}, with_tokenizer)


class SliceReader:
    """The checkpoint's tensors by name, read one slice at a time; the headers are checked against the config."""

    def __init__(self, model_dir: Path, cfg: LlamaConfig):
        self.holder, shapes = read_headers(model_dir)
        check_params(shapes, cfg, str(model_dir))

    def read(self, name: str, plan: ShardPlan) -> np.ndarray:
        """This rank's part of `name` as float32 (vocab slices padded with zero rows to plan.vocab_rows)."""
        s = plan.slice_of(name)
        f = self.holder[name]
        if s is None:
            return f.load_weight(name)
        part = f.load_slice(name, s.dim, s.start, s.stop)
        if s.rows and part.shape[0] < s.rows:
            part = np.concatenate([part, np.zeros((s.rows - part.shape[0], part.shape[1]), np.float32)])
        return part


def load_shard(model_dir: Path, plan: ShardPlan, device, dtype: torch.dtype) -> Weights:
    """This rank's fused weights: accel.weights.Weights over plan.local's shapes, embed/lm_head [ceil(V/N), D]."""
    reader, cfg = SliceReader(Path(model_dir), plan.cfg), plan.cfg

    def tensor(name: str) -> torch.Tensor:
        return host_tensor(reader.read(name, plan)).to(device=device, dtype=dtype)

    def rows(names: list[str]) -> torch.Tensor:
        """The slices stacked by rows, each copied into its place as it is read (one on the host at a time)."""
        spans = [plan.slice_of(n) for n in names]
        out = torch.empty(sum(s.stop - s.start for s in spans), cfg.hidden_size, device=device, dtype=dtype)
        row = 0
        for n, s in zip(names, spans):
            out.narrow(0, row, s.stop - s.start).copy_(host_tensor(reader.read(n, plan)))
            row += s.stop - s.start
        return out

    layers = []
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        layers.append(LayerWeights(
            attn_norm=tensor(p + "input_layernorm.weight"),
            qkv=rows([p + f"self_attn.{n}_proj.weight" for n in "qkv"]),  # [(H+2K)/N·E, D]
            o=tensor(p + "self_attn.o_proj.weight"),  # [D, H/N·E]
            mlp_norm=tensor(p + "post_attention_layernorm.weight"),
            gate_up=rows([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),  # [2F/N, D]
            down=tensor(p + "mlp.down_proj.weight")))  # [D, F/N]
    embed = tensor("model.embed_tokens.weight")  # [ceil(V/N), D]
    lm_head = embed if cfg.tie_word_embeddings else tensor("lm_head.weight")
    return Weights(embed, layers, tensor("model.norm.weight"), lm_head)
