"""LoRA adapters applied unmerged, per request, in the batched step: several adapters (and the base) in one batch.

An adapter (refimpl.formats.lora.load_lora's list of (param name, A [R, Din], B [Dout, R], scale)) is kept beside
the untouched base weights, keyed by the fused projection its matrix feeds (accel.weights): q/k/v_proj -> rows of
qkv, gate/up_proj -> rows of gate_up, o_proj -> o, down_proj -> down. After each projection y = x·Wᵀ over the whole
flat batch, every adapter's rows get their delta: y[rows, part] += scale · (x[rows]·Aᵀ)·Bᵀ, the LoRA branch in fp32
(as accel.ops.add_lora) and rounded once into y. This is the plain torch version, one product pair per adapter and
matrix; a segmented kernel (SGMV: one launch for every adapter's rows) takes the same inputs.
"""
from __future__ import annotations

import re

import numpy as np
import torch

from refimpl.errors import GenerationError
from refimpl.model.config import LlamaConfig

_NAME = re.compile(r"model\.layers\.(\d+)\.(self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj\.weight")


def fused_place(cfg: LlamaConfig, proj: str) -> tuple[str, int]:
    """An HF projection's fused matrix and its first output row there."""
    q, kv, F = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    return {"q": ("qkv", 0), "k": ("qkv", q), "v": ("qkv", q + kv), "o": ("o", 0), "gate": ("gate_up", 0),
            "up": ("gate_up", F), "down": ("down", 0)}[proj]


class AdapterSet:
    """The engine's adapters by name: (layer, fused matrix) -> [(first row, A [R, Din], B [Dout, R], scale)]."""

    def __init__(self, cfg: LlamaConfig, device: torch.device):
        self.cfg, self.device = cfg, device
        self.adapters: dict[str, dict[tuple[int, str], list]] = {}

    def add(self, name: str, adapter: list) -> None:
        if name in self.adapters:
            raise GenerationError(f"adapter {name!r} is already loaded")
        parts: dict[tuple[int, str], list] = {}
        for param, lora_a, lora_b, scale in adapter:
            m = _NAME.fullmatch(param)
            if m is None:
                raise GenerationError(f"adapter {name!r}: {param} is not a decoder layer's projection; the batch "
                                      f"engine applies adapters to q/k/v/o/gate/up/down_proj only")
            fused, row = fused_place(self.cfg, m.group(3))
            a = torch.from_numpy(np.asarray(lora_a, np.float32)).to(self.device)  # [R, Din]
            b = torch.from_numpy(np.asarray(lora_b, np.float32)).to(self.device)  # [Dout, R]
            parts.setdefault((int(m.group(1)), fused), []).append((row, a, b, float(scale)))
        self.adapters[name] = parts

    def __contains__(self, name) -> bool:
        return name in self.adapters

    def apply(self, y: torch.Tensor, x: torch.Tensor, layer: int, fused: str, segments) -> torch.Tensor:
        """y [T, N] = x [T, Din]·Wᵀ of the fused matrix; segments [(adapter name, rows [n] int64)] -> y with each
        adapter's delta added to its rows (in place)."""
        for name, rows in segments:
            parts = self.adapters[name].get((layer, fused))
            if not parts:
                continue
            xa = x.index_select(0, rows).float()  # [n, Din]
            for row, a, b, scale in parts:
                delta = scale * ((xa @ a.t()) @ b.t())  # [n, Din] @ [Din, R] @ [R, Dout] -> [n, Dout], fp32
                cols = slice(row, row + b.shape[0])
                y[rows, cols] = (y[rows, cols].float() + delta).to(y.dtype)
        return y
