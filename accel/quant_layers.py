"""A model's quantized layers on the device: packing each layer at load so that the prefill dequantizes it with one
launch a format (pack_layer, prefill_weights), and quantizing dense device weights by a QuantSpec
(quantize_weights). accel.quant_ops has the matrices and their products; accel.weights loads checkpoints.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from refimpl.quant.schemes import QuantSpec

from .kernels.common import per_row_scales
from .kernels.qdequant import dequantize_layer_fwd, layer_launch
from .ops.dispatch import uses_triton
from .quant_ops import QuantTensor, quantize

# ---------------------------------------------------------------- the prefill: one dequantize launch a layer

MATRICES = ("qkv", "o", "gate_up", "down")
_LAYER_SCRATCH: dict[tuple, list[torch.Tensor]] = {}


@dataclass(eq=False)
class LayerPlan:
    """How a packed layer's quantized matrices are dequantized for the prefill: one launch a format
    (accel.kernels.qdequant.LayerDequant), into one scratch laid out as `layout` ((name, out_at, N, K) a matrix)."""

    launches: list
    layout: tuple
    size: int  # elements of the scratch

    @property
    def nbytes(self) -> int:  # accel.weights.Weights.nbytes counts the packed tables beside the tensors
        return sum(launch.table.nbytes for launch in self.launches)


def _at(n: int, align: int) -> int:
    return -(-n // align) * align


def _into(flat: torch.Tensor, at: int, t: torch.Tensor) -> torch.Tensor:
    """t copied into flat[at:], returned as the view there of t's shape."""
    return flat[at: at + t.numel()].view(t.shape).copy_(t)


def pack_layer(lw):
    """Rearranged at load: the layer's quantized matrices of one format moved into one flat buffer each of codes,
    scales and minima (the QuantTensors become views of them: the decode GEMVs see the same matrices), so that the
    prefill dequantizes the whole layer with one launch a format (prefill_weights) instead of one a matrix."""
    quantized = [(n, getattr(lw, n)) for n in MATRICES if isinstance(getattr(lw, n), QuantTensor)]
    if not quantized:
        return lw
    layout, size = [], 0
    for n, t in quantized:  # matrix starts 128 elements aligned in the scratch: aligned cuBLAS operands
        layout.append((n, size, *t.shape))
        size = _at(size + t.shape[0] * t.K, 128)
    out_at = {n: at for n, at, _, _ in layout}
    formats: dict[tuple, list] = {}
    for n, t in quantized:
        per_row = per_row_scales(t.group, t.K, t.low)
        key = (t.bits, t.offset, per_row, None if per_row else t.group, t.q.dtype, t.scale.dtype,
               None if t.low is None else t.low.dtype)
        formats.setdefault(key, []).append((n, t))
    packed, launches = {}, []
    for (bits, offset, per_row, _, _, _, _), members in formats.items():
        codes_at, scales_at = [], []
        n_codes = n_scales = 0
        for _, t in members:  # 16-element aligned starts: 16-byte code loads, stores and scale vectors
            codes_at.append(n_codes)
            scales_at.append(n_scales)
            n_codes, n_scales = _at(n_codes + t.q.numel(), 16), _at(n_scales + t.scale.numel(), 16)
        first = members[0][1]
        q = torch.zeros(n_codes, dtype=first.q.dtype, device=first.device)
        scale = torch.zeros(n_scales, dtype=first.scale.dtype, device=first.device)
        low = None if first.low is None else torch.zeros(n_scales, dtype=first.low.dtype, device=first.device)
        rows = []
        for (n, t), ca, sa in zip(members, codes_at, scales_at):
            packed[n] = QuantTensor(t.fmt, t.bits, t.group, _into(q, ca, t.q), _into(scale, sa, t.scale),
                                    None if low is None else _into(low, sa, t.low), t.K, t.offset)
            rows.append((ca, sa, out_at[n], t.shape[0], t.K, t.q.shape[1], t.scale.shape[1]))
        launches.append(layer_launch(q, scale, low, rows, bits, offset, first.group, per_row))
    return dataclasses.replace(lw, **packed, plan=LayerPlan(launches, tuple(layout), size))


def prefill_weights(lw, x: torch.Tensor):
    """The layer as the prefill over x [T, D] multiplies by it: for a packed layer (pack_layer) and T > 1 on the
    Triton path, a LayerWeights whose quantized matrices are views of one scratch, filled by one dequantize launch
    a format (one scratch for every layer of one layout: stream order keeps the reuse safe); otherwise lw itself
    (one row takes the GEMVs)."""
    plan = getattr(lw, "plan", None)
    if plan is None or x.shape[0] == 1 or not uses_triton(x):
        return lw
    key = (plan.layout, x.dtype, x.device)
    views = _LAYER_SCRATCH.get(key)
    if views is None:  # [the flat scratch] + one [N, K] view a matrix, in layout order
        flat = torch.empty(plan.size, dtype=x.dtype, device=x.device)
        views = _LAYER_SCRATCH[key] = [flat] + [flat[at: at + N * K].view(N, K) for _, at, N, K in plan.layout]
    for launch in plan.launches:
        dequantize_layer_fwd(launch, views[0])
    dense = {n: v for (n, *_), v in zip(plan.layout, views[1:])}
    return dataclasses.replace(lw, **dense, plan=None)


def quantize_weights(w, spec: QuantSpec):
    """Dense device Weights (the benchmark's random weights) -> the same model quantized on the device; each
    dense matrix is dropped once quantized."""
    for i, lw in enumerate(w.layers):
        one = lambda key: spec.for_matrix(f"model.layers.{i}.{key}")  # noqa: E731  a fused group's format
        lw.qkv, lw.o = quantize(lw.qkv, one("self_attn.q_proj")), quantize(lw.o, one("self_attn.o_proj"))
        lw.gate_up, lw.down = quantize(lw.gate_up, one("mlp.gate_proj")), quantize(lw.down, one("mlp.down_proj"))
        w.layers[i] = pack_layer(lw)
    if spec.lm_head:
        w.lm_head = quantize(w.lm_head, spec.for_matrix("lm_head.weight"))
    return w
