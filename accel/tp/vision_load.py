"""Llama 3.2 Vision over N ranks: which slice of each checkpoint tensor (the Hub's names) a rank keeps, and reading
one rank's slices from the safetensors files.

    language_model self layers      as accel.tp.shard splits a Llama decoder: q/k/v, gate/up column-parallel; o,
                                    down row-parallel (one all-reduce each)
    language_model cross layers     the same split: q_proj H/N heads, k_proj/v_proj the rank's KV heads, o_proj
                                    the matching columns, gate/up/down as a self layer's; q_norm, k_norm (one
                                    weight over the head dim) and the two tanh gates whole. A rank computes the
                                    image keys/values of its own KV heads only, from the whole image tokens.
    embed_tokens                    vocab-parallel over its V + 8 rows (the image token's row among them)
    lm_head                         vocab-parallel over V rows
    vision_model.*, projector       replicated: every rank encodes the image itself
The encoder is replicated, not split: it is ~0.9B parameters in both the 11B and the 90B model (1.9 GB in bf16,
under 2% of a 90B rank's shard), runs once per image, and each rank needs the whole image tokens [N, D] for its KV
heads' keys and values anyway. Split, its 40 layers would cost 80 all-reduces of [I·A·Q, 1280] per image to save
at most half of a once-per-request encode; replicated, it needs no communication and is the one-GPU code as it is.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from refimpl.formats.hf_dir import assemble
from refimpl.formats.params import Checkpoint
from refimpl.formats.vision_checkpoint import check_vision_dir, expected_vision_shapes
from refimpl.model.llama_vision import LM_HEAD, TEXT
from refimpl.model.vision_config import MllamaConfig, MllamaTextConfig
from refimpl.quant.schemes import QuantSpec

from ..vision.weights import CrossLayer, fuse_vision_qkv, vision_gates
from ..weights import LayerWeights, Weights
from .load import ShardReader
from .random_shard import RandomShard
from .shard import ShardPlan, Slice, check_divisible, shard_elements

EMBED = TEXT + "embed_tokens.weight"


@dataclass(frozen=True)
class VisionShardPlan:
    cfg: MllamaConfig  # the whole model's
    rank: int
    world: int

    def __post_init__(self):
        check_divisible(self.cfg.text, self.world)

    @property
    def text(self) -> ShardPlan:
        """The decoder's split (heads, KV heads, hidden units, lm_head rows)."""
        return ShardPlan(self.cfg.text, self.rank, self.world)

    @property
    def local(self) -> MllamaTextConfig:
        """The text config one rank computes with: its heads, KV heads and hidden units."""
        return self.text.local

    @property
    def embed_rows(self) -> int:
        """Rows of embed_tokens a rank holds: ceil((V + 8) / N)."""
        return -(-self.cfg.text.embedding_rows // self.world)

    def embed_range(self) -> tuple[int, int]:
        """The token ids start..stop-1 this rank's embedding rows hold."""
        R, n = self.cfg.text.embedding_rows, self.embed_rows
        return min(self.rank * n, R), min((self.rank + 1) * n, R)

    def slice_of(self, name: str) -> Slice | None:
        """The part of checkpoint tensor `name` (the Hub's name) this rank keeps; None: the whole tensor."""
        if name == EMBED:
            start, stop = self.embed_range()
            return Slice(0, start, stop, self.embed_rows)
        if name == LM_HEAD:
            return self.text.slice_of("lm_head.weight")
        if not name.startswith(TEXT + "layers."):
            return None  # the encoder, the projector, the final norm
        key = name.split(".", 4)[-1].replace("cross_attn.", "self_attn.")  # a cross layer's q/k/v/o as a self one's
        return self.text.slice_of("model.layers.0." + key)


def vision_shard_elements(plan: VisionShardPlan) -> int:
    """The values of every tensor this rank keeps (its slices, padding included, and the replicated ones)."""
    return shard_elements(plan, expected_vision_shapes(plan.cfg))


def open_vision_checkpoint(path: Path, with_tokenizer: bool = True, world: int = 1) -> Checkpoint:
    """A Llama 3.2 Vision directory's config, tokenizer and stop ids, every header checked, no weights read; a
    model `world` ranks cannot split refused before the tokenizer is read."""
    cfg, _ = check_vision_dir(path)
    check_divisible(cfg.text, world)
    return assemble(Path(path), cfg, {}, with_tokenizer)


class VisionSlices:
    """A directory's tensors by the Hub's name (either key scheme on disk), read one slice at a time."""

    def __init__(self, model_dir: Path):
        self.cfg, self.located = check_vision_dir(model_dir)

    def whole(self, name: str) -> np.ndarray:
        file, key = self.located[name]
        return file.load_weight(key)

    def part(self, name: str, s: Slice) -> np.ndarray:
        file, key = self.located[name]
        return file.load_slice(key, s.dim, s.start, s.stop)


@dataclass
class TPVisionWeights:
    """One rank's Llama 3.2 Vision: the decoder's self layers as accel.tp.load builds a text shard (text.layers[j]
    is layer self_layers[j]; text.embed [ceil((V+8)/N), D], text.lm_head [ceil(V/N), D]), the cross layers'
    slices (accel.vision.weights.CrossLayer: q [H/N·E, D], o [D, H/N·E], gate_up [2F/N, D], down [D, F/N]), each
    cross layer's image-side k, v [K/N·E, D] and k_norm [E], and the replicated encoder + projector by checkpoint
    name with its load-time rearrangements (fused q/k/v, the global layers' gates as numbers)."""

    text: Weights
    self_layers: list[int]
    cross: list[CrossLayer]
    image_kv: list[tuple]  # (k, v, k_norm) a cross layer, in cross_attention_layers' order
    vision: dict[str, torch.Tensor]
    vision_qkv: dict[str, torch.Tensor]
    vision_gates: list[tuple[float, float]]


def _self_layer(r: ShardReader, i: int) -> LayerWeights:
    p, key = f"{TEXT}layers.{i}.", f"model.layers.{i}."  # key: the name QuantSpec.for_matrix reads
    return LayerWeights(
        attn_norm=r.tensor(p + "input_layernorm.weight"),
        qkv=r.matrix([p + f"self_attn.{n}_proj.weight" for n in "qkv"], key + "self_attn.q_proj.weight"),
        o=r.matrix([p + "self_attn.o_proj.weight"], key + "self_attn.o_proj.weight"),
        mlp_norm=r.tensor(p + "post_attention_layernorm.weight"),
        gate_up=r.matrix([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], key + "mlp.gate_proj.weight"),
        down=r.matrix([p + "mlp.down_proj.weight"], key + "mlp.down_proj.weight"))


def _cross_layer(r: ShardReader, i: int) -> tuple[CrossLayer, tuple]:
    p, key = f"{TEXT}layers.{i}.", f"model.layers.{i}."
    layer = CrossLayer(
        attn_norm=r.tensor(p + "input_layernorm.weight"),
        q=r.matrix([p + "cross_attn.q_proj.weight"], key + "self_attn.q_proj.weight"),  # [H/N·E, D]
        q_norm=r.tensor(p + "cross_attn.q_norm.weight"),
        o=r.matrix([p + "cross_attn.o_proj.weight"], key + "self_attn.o_proj.weight"),  # [D, H/N·E]
        attn_gate=r.tensor(p + "cross_attn_attn_gate"),
        mlp_norm=r.tensor(p + "post_attention_layernorm.weight"),
        gate_up=r.matrix([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], key + "mlp.gate_proj.weight"),
        down=r.matrix([p + "mlp.down_proj.weight"], key + "mlp.down_proj.weight"),
        mlp_gate=r.tensor(p + "cross_attn_mlp_gate"))
    kv = (r.matrix([p + "cross_attn.k_proj.weight"], key + "self_attn.k_proj.weight"),  # [K/N·E, D]
          r.matrix([p + "cross_attn.v_proj.weight"], key + "self_attn.v_proj.weight"),
          r.tensor(p + "cross_attn.k_norm.weight"))
    return layer, kv


def load_vision_shard(model_dir: Path, plan: VisionShardPlan, device, dtype: torch.dtype,
                      spec: QuantSpec | None = None) -> TPVisionWeights:
    """This rank's weights (TPVisionWeights), read slice by slice; with `spec` the decoder's matrices (and the
    lm_head unless spec.lm_head is False) quantized as accel.tp.load.ShardReader does, the encoder in `dtype`."""
    return build_vision_shard(ShardReader(VisionSlices(Path(model_dir)), plan, device, dtype, spec), plan)


def build_vision_shard(r, plan: VisionShardPlan) -> TPVisionWeights:
    """TPVisionWeights from a reader of this rank's tensors: r.tensor(name), r.matrix(names, quant key) and
    r.spec (accel.tp.load.ShardReader, or accel.tp.random_shard.RandomShard for the benchmark)."""
    t = plan.cfg.text
    self_layers = [i for i in range(t.num_hidden_layers) if i not in t.cross_attention_layers]
    layers = [_self_layer(r, i) for i in self_layers]
    cross = [_cross_layer(r, i) for i in t.cross_attention_layers]
    head = r.matrix([LM_HEAD], "lm_head.weight") if r.spec is not None and r.spec.lm_head else r.tensor(LM_HEAD)
    text = Weights(r.tensor(EMBED), layers, r.tensor(TEXT + "norm.weight"), head)
    vision = {name: r.tensor(name) for name in expected_vision_shapes(plan.cfg)
              if name.startswith(("vision_model.", "multi_modal_projector."))}
    return TPVisionWeights(text, self_layers, [c for c, _ in cross], [kv for _, kv in cross], vision,
                           fuse_vision_qkv(vision, plan.cfg), vision_gates(vision, plan.cfg))


def random_vision_shard(plan: VisionShardPlan, device, dtype: torch.dtype, spec: QuantSpec | None = None,
                        seed: int = 0) -> TPVisionWeights:
    """Random weights drawn as this rank's shard on its device (accel.tp.random_shard: the benchmark's 90B)."""
    return build_vision_shard(RandomShard(plan, expected_vision_shapes(plan.cfg), device, dtype, spec, seed), plan)
