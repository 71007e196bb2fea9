"""Loading one rank's shard of a checkpoint, slice by slice.

Each tensor's slice (accel.tp.shard.ShardPlan.slice_of) is read on its own, widened to float32, copied to the
device in the run's dtype and dropped; so a rank's host memory peaks near its own shard (on CPU, where the shard
lives) plus one slice. From safetensors, only the slice's bytes are read
(refimpl.formats.safetensors_io.SafetensorsFile.load_slice: never the whole tensor, never a memory map); from a
GGUF file, a row slice's blocks alone are dequantized (a row is whole blocks), a column slice's tensor whole, and only
the slice kept. Then fused as accel.weights fuses the whole model: qkv = [q; k; v] and gate_up = [gate; up] of this
rank's rows; with --quant, each fused matrix quantized on the device as it is built (ShardReader, which
accel.tp.vision_load's loader shares).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch

from refimpl.errors import CheckpointError, GenerationError
from refimpl.family import family_of_config_json
from refimpl.formats.gguf_check import validate_gguf
from refimpl.formats.gguf_loader import (ROPE_FREQS, Metadata, config_from_gguf, dequantize, file_tensors, hf_name,
                                         numpy_shape, stop_ids_from, unpermute_rows)
from refimpl.formats.gguf_tokenizer import build_tokenizer
from refimpl.formats.hf_dir import assemble
from refimpl.formats.jsonfile import read_config_json
from refimpl.formats.params import Checkpoint, check_params
from refimpl.formats.quant_checkpoint import declares_quantization
from refimpl.formats.safe_open import open_regular, stat_path
from refimpl.formats.shards import read_headers
from refimpl.model.config import LlamaConfig
from refimpl.quant.schemes import INT_FORMATS, QuantSpec

from ..quant_ops import quantize
from ..weights import LayerWeights, Weights, host_tensor
from .shard import ShardPlan, Slice, check_divisible


def open_text_checkpoint(path: Path, with_tokenizer: bool = True, world: int = 1) -> Checkpoint:
    """A text checkpoint's config, tokenizer and stop ids, with no weights read (params empty): what the rank
    owning the CLI needs besides its shard. A quantized or a vision checkpoint is refused, and a model `world`
    ranks cannot split (accel.tp.shard.check_divisible) before the tokenizer is read."""
    path = Path(path)
    st = stat_path(path, "expected a model directory or a .gguf file")
    if st is None:
        raise CheckpointError(f"{path}: no such file or directory (expected a model directory or a .gguf file)")
    if is_gguf(path):
        return GGUFSlices(path).checkpoint(with_tokenizer, world)
    config = read_config_json(path / "config.json")
    if declares_quantization(config):
        raise CheckpointError(f"{path}: --tp > 1 runs float checkpoints only for now; this one is quantized")
    if family_of_config_json(config).name != "text":
        raise CheckpointError(f"{path}: --tp > 1 runs text models only for now; this is a Llama 3.2 Vision model")
    cfg = LlamaConfig.from_hf(config, source=str(path / "config.json"))
    check_divisible(cfg, world)
    SafetensorsSlices(path, cfg)  # every tensor's name and shape, from the headers
    return assemble(path, cfg, {}, with_tokenizer)


def is_gguf(path: Path) -> bool:
    if path.is_dir():
        return False
    with open_regular(path, "expected a model directory or a .gguf file") as f:
        return path.suffix == ".gguf" or f.read(4) == b"GGUF"


class SafetensorsSlices:
    """A directory's tensors by name, read one slice at a time; the headers are checked against the config."""

    def __init__(self, model_dir: Path, cfg: LlamaConfig):
        self.holder, shapes = read_headers(model_dir)
        check_params(shapes, cfg, str(model_dir))

    def whole(self, name: str) -> np.ndarray:
        return self.holder[name].load_weight(name)

    def part(self, name: str, s: Slice) -> np.ndarray:
        return self.holder[name].load_slice(name, s.dim, s.start, s.stop)


class GGUFSlices:
    """A GGUF file's tensors by HF name, dequantized as refimpl.formats.gguf_loader does (q/k rows put back in HF's
    order): a row slice from its own blocks, a column slice from the whole tensor, of which only the slice is kept."""

    def __init__(self, path: Path):
        self.path, self.source = path, str(path)
        header = validate_gguf(path)
        self.meta = Metadata(header.fields, self.source)
        self.tensors = file_tensors(path, header)
        self.by_name = {hf_name(t.name): t for t in self.tensors if hf_name(t.name) is not None}
        tokens = header.fields.get("tokenizer.ggml.tokens")
        rope = next((dequantize(t, self.source) for t in self.tensors if t.name == ROPE_FREQS), None)
        self.stop = stop_ids_from(self.meta)
        self.cfg = config_from_gguf(self.meta, {t.name: numpy_shape(t) for t in self.tensors}, rope,
                                    len(tokens[1]) if tokens is not None else None, self.stop)
        check_params({n: numpy_shape(t) for n, t in self.by_name.items()}, self.cfg, self.source)

    def checkpoint(self, with_tokenizer: bool, world: int) -> Checkpoint:
        check_divisible(self.cfg, world)
        tokenizer = build_tokenizer(self.meta, self.source) if with_tokenizer else None
        return Checkpoint(self.path, self.cfg, {}, tokenizer, self.stop)

    def _hf_rows(self, name: str, tensor) -> np.ndarray:
        """A tensor (or rows of one: whole heads for q/k) dequantized, q/k rows unpermuted head by head."""
        w = dequantize(tensor, self.source)
        if name.split(".", 3)[-1] in ("self_attn.q_proj.weight", "self_attn.k_proj.weight"):
            w = unpermute_rows(w, w.shape[0] // self.cfg.head_dim)
        return w

    def whole(self, name: str) -> np.ndarray:
        return self._hf_rows(name, self.by_name[name])

    def part(self, name: str, s: Slice) -> np.ndarray:
        t = self.by_name[name]
        if s.dim == 1:
            return np.array(self.whole(name)[:, s.start:s.stop])  # a copy: the whole tensor is dropped
        rows, cols = numpy_shape(t)
        per_row = t.data.shape[0] // rows  # bytes of one row's blocks
        part = dataclasses.replace(t, data=t.data[s.start * per_row:s.stop * per_row], dims=(cols, s.stop - s.start))
        return self._hf_rows(name, part)


def read(source, name: str, plan: ShardPlan) -> np.ndarray:
    """This rank's part of `name` as float32 (vocab slices padded with zero rows to plan.vocab_rows)."""
    s = plan.slice_of(name)
    if s is None:
        return source.whole(name)
    part = source.part(name, s)
    if s.rows and part.shape[0] < s.rows:
        part = np.concatenate([part, np.zeros((s.rows - part.shape[0], part.shape[1]), np.float32)])
    return part


class ShardReader:
    """A rank's tensors built from its slices (`read`), one slice on the host at a time, on `device`: norms and
    vectors in `dtype`; matrices in `dtype`, or quantized by `spec` (a refimpl.quant.schemes.QuantSpec, int8 or
    int4) into accel.quant_ops.QuantTensors, each from its float32 slices (as the one-device engine quantizes the
    checkpoint's float32 values). A column-parallel slice keeps whole rows, so its scales are the unsharded
    matrix's; a row-parallel slice (o, down) keeps 1/N of each row's columns, so its int8 scale is that column
    slice's own max |w| / 127 (int8 with groups of K/N on the whole matrix; int4's groups of G are the unsharded
    ones whenever G divides K/N)."""

    def __init__(self, source, plan, device, dtype: torch.dtype, spec: QuantSpec | None = None):
        self.source, self.plan, self.device, self.dtype, self.spec = source, plan, device, dtype, spec

    def tensor(self, name: str) -> torch.Tensor:
        return host_tensor(read(self.source, name, self.plan)).to(device=self.device, dtype=self.dtype)

    def rows(self, names: list[str], dtype: torch.dtype | None = None) -> torch.Tensor:
        """The slices stacked by rows, each copied into its place as it is read (one on the host at a time)."""
        dtype = dtype or self.dtype
        if len(names) == 1:  # a row or a column slice
            return host_tensor(read(self.source, names[0], self.plan)).to(device=self.device, dtype=dtype)
        spans = [self.plan.slice_of(n) for n in names]  # row slices (q/k/v, gate/up) of one width
        out, row = None, 0
        for n, s in zip(names, spans):
            part = host_tensor(read(self.source, n, self.plan))
            if out is None:
                out = torch.empty(sum(s.stop - s.start for s in spans), part.shape[1], device=self.device,
                                  dtype=dtype)
            out.narrow(0, row, s.stop - s.start).copy_(part)
            row += s.stop - s.start
        return out

    def matrix(self, names: list[str], key: str):
        """A (fused) matrix of these slices: dense in the run's dtype, or quantized by the spec's format for `key`
        (the first name, as QuantSpec.for_matrix reads it: a fused group takes one format)."""
        if self.spec is None:
            return self.rows(names)
        return quantize(self.rows(names, torch.float32), self.spec.for_matrix(key))


def check_quant(spec: QuantSpec | None) -> None:
    """--quant with --tp: the formats a rank can make of its own slices (int8, int4)."""
    if spec is not None and spec.format not in INT_FORMATS:
        raise GenerationError(f"--quant {spec.format} with --tp: each rank quantizes its own slices at load, in "
                              f"int8 or int4; a GGUF file's blocks are not kept under --tp")


def load_shard(model_dir: Path, plan: ShardPlan, device, dtype: torch.dtype,
               spec: QuantSpec | None = None) -> Weights:
    """This rank's fused weights: accel.weights.Weights over plan.local's shapes, embed/lm_head [ceil(V/N), D];
    with `spec`, the layers' matrices (and the lm_head unless spec.lm_head is False) quantized (ShardReader)."""
    path, cfg = Path(model_dir), plan.cfg
    source = GGUFSlices(path) if is_gguf(path) else SafetensorsSlices(path, cfg)
    r = ShardReader(source, plan, device, dtype, spec)
    layers = []
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        layers.append(LayerWeights(
            attn_norm=r.tensor(p + "input_layernorm.weight"),
            qkv=r.matrix([p + f"self_attn.{n}_proj.weight" for n in "qkv"], p + "self_attn.q_proj.weight"),
            o=r.matrix([p + "self_attn.o_proj.weight"], p + "self_attn.o_proj.weight"),  # [D, H/N·E]
            mlp_norm=r.tensor(p + "post_attention_layernorm.weight"),
            gate_up=r.matrix([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], p + "mlp.gate_proj.weight"),
            down=r.matrix([p + "mlp.down_proj.weight"], p + "mlp.down_proj.weight")))  # [D, F/N]
    embed = r.tensor("model.embed_tokens.weight")  # [ceil(V/N), D]
    lm_head = embed
    if not cfg.tie_word_embeddings or (spec is not None and spec.lm_head):
        head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        lm_head = r.matrix([head], "lm_head.weight") if spec is not None and spec.lm_head else r.tensor(head)
    return Weights(embed, layers, r.tensor("model.norm.weight"), lm_head)
