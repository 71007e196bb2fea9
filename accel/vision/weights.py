"""Llama 3.2 Vision weights on the device.

The text decoder's self-attention layers, embedding, final norm and lm_head go through accel.weights (fused qkv and
gate_up, rearranged once at load); the cross-attention layers' gate and up projections are fused the same way
(`CrossLayer.gate_up`), and all cross layers' k and v projections into one matrix each (`CrossImageKV`: a request's
image keys/values are two GEMMs); each encoder layer's q/k/v into one (`vision_qkv`); everything else stays one
tensor per checkpoint name. `params` gives every tensor by its checkpoint name (views of the fused ones), for trace
mode, which runs refimpl.model.llama_vision.forward_steps over accel.ops.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from refimpl.model.llama_vision import LM_HEAD, TEXT
from refimpl.model.vision_config import MllamaConfig

from ..weights import Weights, load_weights, params_view, random_weights, to_device


def fuse_rows(params: dict[str, torch.Tensor], names: list[str]) -> torch.Tensor:
    """The named matrices stacked along their rows into one tensor (one GEMM for all of them); `params` then holds
    views of it under the checkpoint names (no second copy)."""
    fused = torch.cat([params[n] for n in names])  # n × [R_i, D] -> [ΣR_i, D]
    for n, view in zip(names, fused.split([params[n].shape[0] for n in names])):
        params[n] = view
    return fused


@dataclass
class CrossLayer:
    """A cross-attention layer's tensors the fast path reads (views of `params`)."""

    attn_norm: torch.Tensor  # [D]
    q: torch.Tensor  # [H·E, D]
    q_norm: torch.Tensor  # [E]
    o: torch.Tensor  # [D, H·E]
    attn_gate: torch.Tensor  # [1], before tanh
    mlp_norm: torch.Tensor  # [D]
    gate_up: torch.Tensor  # [2F, D]: gate rows, then up rows
    down: torch.Tensor  # [D, F]
    mlp_gate: torch.Tensor  # [1], before tanh

    @classmethod
    def of(cls, params: dict, i: int, gate_up: torch.Tensor) -> "CrossLayer":
        p = lambda key: params[f"{TEXT}layers.{i}.{key}"]  # noqa: E731
        return cls(p("input_layernorm.weight"), p("cross_attn.q_proj.weight"), p("cross_attn.q_norm.weight"),
                   p("cross_attn.o_proj.weight"), p("cross_attn_attn_gate"), p("post_attention_layernorm.weight"),
                   gate_up, p("mlp.down_proj.weight"), p("cross_attn_mlp_gate"))


@dataclass
class CrossImageKV:
    """Every cross layer's image-side projections, fused at load (params keep views); layer c's rows at c·K·E."""

    k: torch.Tensor  # [C·K·E, D]: the k_proj weights stacked
    v: torch.Tensor  # [C·K·E, D]: the v_proj weights stacked
    k_norm: torch.Tensor  # [C, E]: the k_norm weights stacked
    ones: torch.Tensor  # [E]: RMSNorm's weight when the layers' own are applied after it, all layers at once

    @classmethod
    def of(cls, params: dict, cfg: MllamaConfig) -> "CrossImageKV | None":
        layers = cfg.text.cross_attention_layers
        if not layers:
            return None
        k, v = (fuse_rows(params, [f"{TEXT}layers.{i}.cross_attn.{m}_proj.weight" for i in layers])
                for m in ("k", "v"))  # C × [K·E, D] -> [C·K·E, D] each
        k_norm = torch.stack([params[f"{TEXT}layers.{i}.cross_attn.k_norm.weight"] for i in layers])  # [C, E]
        return cls(k, v, k_norm, torch.ones_like(k_norm[0]))

    def layer(self, c: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Cross layer c's own (k [K·E, D], v [K·E, D], k_norm [E]): views."""
        n = self.k.shape[0] // self.k_norm.shape[0]  # K·E
        return self.k[c * n:(c + 1) * n], self.v[c * n:(c + 1) * n], self.k_norm[c]


@dataclass
class VisionWeights:
    text: Weights  # the self-attention layers only, in order (text.layers[j] is self_layers[j])
    self_layers: list[int]  # their indices in the decoder
    params: dict[str, torch.Tensor]  # every tensor by its checkpoint name
    cross: list[CrossLayer] = dataclasses.field(default_factory=list)  # cfg.text.cross_attention_layers' order
    vision_qkv: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # encoder layer -> [3·U, U] q;k;v
    vision_gates: list[tuple[float, float]] = dataclasses.field(default_factory=list)  # global layer -> tanh(gates)
    image_kv: CrossImageKV | None = None

    def nbytes_per_token(self, cfg: MllamaConfig) -> int:
        """Bytes of weights a decode step with an image in context reads: the text model's self layers,
        lm_head and norms, plus every cross layer's q/o/MLP matrices (their k/v act once per image)."""
        n = self.text.nbytes_per_token()
        for i in cfg.text.cross_attention_layers:
            for key in ("input_layernorm.weight", "cross_attn.q_proj.weight", "cross_attn.o_proj.weight",
                        "cross_attn.q_norm.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight",
                        "mlp.up_proj.weight", "mlp.down_proj.weight"):
                t = self.params[f"{TEXT}layers.{i}.{key}"]
                n += t.numel() * t.element_size()
        return n

    def nbytes(self) -> int:
        seen, n = set(), 0
        for t in self.params.values():
            base = t.untyped_storage().data_ptr()
            if base not in seen:
                seen.add(base)
                n += t.untyped_storage().nbytes()
        return n


def self_layer_config(cfg: MllamaConfig):
    """The text config restricted to its self-attention layers, as accel.weights and accel.model read it."""
    t = cfg.text
    n = t.num_hidden_layers - len(t.cross_attention_layers)
    return dataclasses.replace(t, num_hidden_layers=n, cross_attention_layers=())


def _text_renames(cfg: MllamaConfig) -> tuple[list[int], dict[str, str]]:
    """(self layer indices, accel.weights name -> checkpoint name) for the text decoder's fused part."""
    self_layers = [i for i in range(cfg.text.num_hidden_layers) if i not in cfg.text.cross_attention_layers]
    names = {"model.embed_tokens.weight": TEXT + "embed_tokens.weight", "model.norm.weight": TEXT + "norm.weight",
             "lm_head.weight": LM_HEAD}
    for j, i in enumerate(self_layers):
        for key in ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.o_proj.weight",
                    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"):
            names[f"model.layers.{j}.{key}"] = f"{TEXT}layers.{i}.{key}"
    return self_layers, names


def fuse_vision_qkv(params: dict[str, torch.Tensor], cfg: MllamaConfig) -> dict[str, torch.Tensor]:
    """Every encoder layer's q/k/v projections as one [3·U, U] matrix (one GEMM a layer), keyed by the layer's
    prefix; `params` then holds views of it under the checkpoint names (no second copy)."""
    v = cfg.vision
    fused = {}
    for stack, n in (("transformer", v.num_hidden_layers), ("global_transformer", v.num_global_layers)):
        for i in range(n):
            prefix = f"vision_model.{stack}.layers.{i}."
            fused[prefix] = fuse_rows(params, [f"{prefix}self_attn.{x}_proj.weight" for x in "qkv"])  # [3·U, U]
    return fused


def vision_gates(params: dict[str, torch.Tensor], cfg: MllamaConfig) -> list[tuple[float, float]]:
    """tanh of every global encoder layer's (attention, MLP) gates as numbers, read to the host once at load: the
    encoder scales by them in addmm/add (which take a number), and a read per encode would be a host sync."""
    names = [f"vision_model.global_transformer.layers.{i}.gate_{g}" for i in range(cfg.vision.num_global_layers)
             for g in ("attn", "ffn")]
    if not names:
        return []
    g = torch.cat([params[n].reshape(1).float() for n in names]).tanh().tolist()
    return list(zip(g[0::2], g[1::2]))


def _with_vision(w: VisionWeights, cfg: MllamaConfig) -> VisionWeights:
    """The encoder's load-time rearrangements: fused q/k/v, gates as numbers."""
    w.vision_qkv = fuse_vision_qkv(w.params, cfg)
    w.vision_gates = vision_gates(w.params, cfg)
    return w


def load_vision_weights(params: dict[str, np.ndarray], cfg: MllamaConfig, device, dtype: torch.dtype) -> VisionWeights:
    """float32 NumPy params keyed by the Hub's names -> device tensors in `dtype`, one at a time."""
    self_layers, names = _text_renames(cfg)
    sub = self_layer_config(cfg)
    text = load_weights({short: params[full] for short, full in names.items()}, sub, device, dtype)
    out = {names[short]: t for short, t in params_view(text, sub).items()}
    for name, array in params.items():
        if name not in out:
            out[name] = to_device(array, device, dtype)
    return _with_cross_layers(_with_vision(VisionWeights(text, self_layers, out), cfg), cfg)


def _with_cross_layers(w: VisionWeights, cfg: MllamaConfig) -> VisionWeights:
    """Each cross layer's gate and up projections moved into one [2F, D] tensor (params keep views of it), so
    that the decode step runs them as one GEMV, as the self layers' gate_up; the image-side k/v fused likewise."""
    w.image_kv = CrossImageKV.of(w.params, cfg)
    w.cross = []
    for i in cfg.text.cross_attention_layers:
        gate_up = fuse_rows(w.params, [f"{TEXT}layers.{i}.mlp.{m}_proj.weight" for m in ("gate", "up")])  # [2F, D]
        w.cross.append(CrossLayer.of(w.params, i, gate_up))
    return w


def random_vision_weights(cfg: MllamaConfig, device, dtype: torch.dtype, shapes: dict, seed: int = 0,
                          std: float = 0.02) -> VisionWeights:
    """Random weights built on the device at the given checkpoint shapes (the benchmark's real-size model):
    norms 1 + N(0, 0.1²), gates 0.5, matrices/embeddings/biases N(0, std²)."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)

    def draw(name, shape):
        x = torch.randn(shape, device=device, dtype=torch.float32, generator=g)
        if "gate" in name and "proj" not in name and len(shape) == 1 and shape[0] == 1:
            return torch.full(shape, 0.5, device=device, dtype=dtype)
        if "norm" in name and name.endswith("weight"):
            return (1 + 0.1 * x).to(dtype)
        return (std * x).to(dtype)

    self_layers, names = _text_renames(cfg)
    sub = self_layer_config(cfg)
    text = random_weights(sub, device, dtype, seed=seed, std=std)
    text.embed = draw("embed", shapes[TEXT + "embed_tokens.weight"])  # [V + 8, D]: the image token rows too
    out = {names[short]: t for short, t in params_view(text, sub).items()}
    for name, shape in shapes.items():
        if name not in out:
            out[name] = draw(name, shape)
    return _with_cross_layers(_with_vision(VisionWeights(text, self_layers, out), cfg), cfg)
