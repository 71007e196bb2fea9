"""PEFT LoRA adapters stacked on the device for the batch engine's unmerged product (accel/batch/runner.py, through
accel/ops/lora_batch.py).

For each decoder layer and each of accel's fused weights (accel/weights.py: qkv, o, gate_up, down) one pair
    A [N, R, Din]   every adapter's lora_A of the modules fused there, stacked along the rank
    B [N, Dout, R]  its lora_B · scale, block-diagonal: module m's rows of the fused output take m's ranks only
so one segmented product adds every adapter's q, k and v updates to the fused qkv GEMM's output at once (and gate
and up to gate_up's). R is the largest total rank of any adapter at that weight; the rest of a smaller adapter's
ranks are zero. Each module's scale (alpha / r, or rslora's, with rank_pattern / alpha_pattern) is folded into its
B in fp32 before the cast, so the product's own scale is 1 for every adapter. An adapter that does not adapt a
weight has zero A and B there.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import torch

from accel.kernels.lora_sgmv import segment_tiles, tiles_tensor
from accel.ops.lora_batch import lora_sgmv
from refimpl.errors import GenerationError
from refimpl.model.config import LlamaConfig

_LAYER_PARAM = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)_proj\.weight$")


def fused_slots(cfg: LlamaConfig) -> dict[str, tuple[str, int]]:
    """Module (q, k, v, o, gate, up, down) -> (accel's fused weight, first row of its output there)."""
    return {"q": ("qkv", 0), "k": ("qkv", cfg.q_size), "v": ("qkv", cfg.q_size + cfg.kv_size), "o": ("o", 0),
            "gate": ("gate_up", 0), "up": ("gate_up", cfg.intermediate_size), "down": ("down", 0)}


def fused_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, int]]:
    """accel's fused weight -> (Dout, Din)."""
    D, F = cfg.hidden_size, cfg.intermediate_size
    return {"qkv": (cfg.q_size + 2 * cfg.kv_size, D), "o": (D, cfg.q_size), "gate_up": (2 * F, D), "down": (D, F)}


@dataclass
class LoraStack:
    names: tuple[str, ...]  # adapter names; a row's adapter index is its position here
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]  # per layer: fused weight -> (A, B)
    scales: torch.Tensor  # [N] fp32 ones: the scales are in B

    def index(self, name: str | None) -> int:
        """A request's adapter name -> its index in the stack (-1: the base model)."""
        return -1 if name is None else self.names.index(name)

    def tiles(self, adapter_per_row: list[str | None], device) -> torch.Tensor:
        """Each row's adapter name (None: the base model) -> the tiles `add` takes, built once for every layer."""
        return tiles_tensor(segment_tiles([self.index(a) for a in adapter_per_row]), device)

    def add(self, layer: int, weight: str, y: torch.Tensor, x: torch.Tensor, tiles: torch.Tensor) -> torch.Tensor:
        """y = x @ W.T of fused weight `weight` in `layer` ([T, Dout], updated in place) plus each row's adapter
        update (tiles: accel.kernels.lora_sgmv.tiles_tensor of the rows' adapter indices); y as it was where no
        adapter adapts this weight."""
        pair = self.layers[layer].get(weight)
        if pair is None or tiles.shape[0] == 0:
            return y
        return lora_sgmv(y, x, pair[0], pair[1], self.scales, tiles)


def _by_weight(adapter, cfg: LlamaConfig, name: str) -> dict:
    """load_lora's [(param, A, B, scale)] -> {(layer, fused weight): [(first row, A, scale · B)]}."""
    slots, out = fused_slots(cfg), {}
    for param, lora_a, lora_b, scale in adapter:
        m = _LAYER_PARAM.match(param)
        if not m or m.group(3) not in slots:
            raise GenerationError(f"adapter {name!r} adapts {param}: batched LoRA applies adapters to the decoder "
                                  f"layers' q/k/v/o/gate/up/down_proj only (merge this adapter instead)")
        weight, row = slots[m.group(3)]
        out.setdefault((int(m.group(1)), weight), []).append((row, lora_a, np.float32(scale) * lora_b))
    return out


def stack_adapters(adapters: dict, cfg: LlamaConfig, device, dtype: torch.dtype) -> LoraStack:
    """adapters: {name: refimpl.formats.lora.load_lora's list}, in index order -> the stacked device tensors."""
    names = tuple(adapters)
    parts = [_by_weight(adapters[n], cfg, n) for n in names]
    shapes = fused_shapes(cfg)
    layers = []
    for layer in range(cfg.num_hidden_layers):
        stacked = {}
        for weight, (d_out, d_in) in shapes.items():
            pieces = [p.get((layer, weight), []) for p in parts]
            rank = max((sum(a.shape[0] for _, a, _ in ps) for ps in pieces), default=0)
            if rank == 0:
                continue
            A = np.zeros((len(names), rank, d_in), np.float32)  # [N, R, Din]
            B = np.zeros((len(names), d_out, rank), np.float32)  # [N, Dout, R]
            for i, ps in enumerate(pieces):
                r0 = 0
                for row, lora_a, lora_b in ps:  # lora_a [r, Din], lora_b [dout_m, r]
                    r = lora_a.shape[0]
                    A[i, r0:r0 + r] = lora_a
                    B[i, row:row + lora_b.shape[0], r0:r0 + r] = lora_b
                    r0 += r
            stacked[weight] = (torch.from_numpy(A).to(device=device, dtype=dtype),
                               torch.from_numpy(B).to(device=device, dtype=dtype))
        layers.append(stacked)
    return LoraStack(names, layers, torch.ones(len(names), dtype=torch.float32, device=device))
