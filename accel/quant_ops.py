"""Weight-only quantized weights on the device: the QuantTensor record, quantizing on the device (bit for bit
refimpl.quant's oracle), converting refimpl's QuantizedLinear records, and the quantized versions of the decode
step's fused GEMV ops as its methods (accel.ops.fused calls them on a QuantTensor weight). Packing a model's
quantized layers for the prefill: accel/quant_layers.py; loading them: accel/weights.py.

One device layout serves every format (accel/kernels/qgemv.py): codes, then a scale (and a minimum) per GROUP
columns. int8 and int4 are refimpl.quant.schemes' own layouts; GGUF blocks are rearranged once at load:
    Q8_0  -> 8-bit codes, GROUP 32, scale d (fp16)
    Q4_0  -> 4-bit codes repacked low-nibble-first, offset 8, GROUP 32, scale d: (q − 8)·d, as the file defines it
    Q4_1  -> 4-bit codes repacked, GROUP 32, scale d, minimum m (fp16)
Every product code·scale is exact in fp32 (≤ 8 × 11 significant bits), so dequantizing here gives the oracle's
bits. A one-row product (the prefill's lm_head, trace mode's decode) takes the GEMV. The prefill (more rows) takes
cuBLAS over dequantized copies: at load, quant_layers.pack_layer puts each layer's matrices of one format into
flat buffers, so that quant_layers.prefill_weights dequantizes the whole layer (accel/kernels/qdequant.py) with one
launch a format into one scratch, reused layer after layer (stream order keeps the reuse safe) — one launch a layer
instead of four, which is what the host pays for. A matrix outside a packed layer (the lm_head) takes a launch and
a scratch of its own (QuantTensor.linear).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from refimpl.quant.schemes import QuantizedLinear, QuantSpec, pack_nibbles
from refimpl.quant.gguf_blocks import block_fields

from .kernels.qdequant import dequantize_fwd
from .kernels.qgemv import qgemv_fwd
from .kernels.qgemv_fused import gate_up_swiglu_qfwd, qkv_rope_qfwd
from .kernels.tuning import DEFAULT, Tuning
from .ops.dispatch import uses_triton
from .ops.torch_ops import (gated_add, torch_linear_add, torch_norm_linear, torch_qkv_rope, torch_swiglu_gate_up,
                            torch_swiglu_linear_add)

_DEQUANT_SCRATCH: dict[tuple, torch.Tensor] = {}  # QuantTensor.linear's, one a shape, dtype and device


@dataclass(eq=False)
class QuantTensor:
    """A quantized [N, K] matrix on the device (module doc). Usable as F.linear's weight (__torch_function__)."""

    fmt: str  # int8 | int4 | q8_0 | q4_0 | q4_1
    bits: int
    group: int  # columns a scale; K for int8's one scale a row
    q: torch.Tensor  # int8 [N, K] or uint8 [N, K/2]
    scale: torch.Tensor  # [N, ceil(K/group)]
    low: torch.Tensor | None  # minima, like scale, or None
    K: int
    offset: int = 0  # subtracted from every code (GGUF Q4_0: 8)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.q.shape[0], self.K)

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.q, self.scale, self.low) if t is not None)

    def narrow(self, dim: int, start: int, length: int) -> "QuantTensor":
        """Rows start .. start+length (views): HF-named views of the fused matrices (accel.weights.params_view)."""
        assert dim == 0, "a quantized matrix narrows along its rows only"
        pick = lambda t: None if t is None else t.narrow(0, start, length)  # noqa: E731
        return QuantTensor(self.fmt, self.bits, self.group, pick(self.q), pick(self.scale), pick(self.low), self.K,
                           self.offset)

    def dequantize(self, dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.empty(self.shape, dtype=dtype, device=self.device) if out is None else out
        if uses_triton(self.q):
            return dequantize_fwd(self.q, self.scale, self.low, self.bits, self.offset, self.group, self.K, out)
        return out.copy_(torch_dequantize(self))

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is not F.linear:
            return NotImplemented
        x, weight = args[0], args[1]
        return weight.linear(x)

    # ---- the products: the weight's type chooses its kernels (accel.ops.fused calls these on a QuantTensor;
    # accel.ops.dense.DenseMatrix has the same methods for a plain tensor). tuning: the QGEMV table and launch mode.

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """F.linear(x, self) for x [..., K]: the GEMV for one row, else a dequantized scratch copy and cuBLAS."""
        N, K = self.shape
        if x.numel() == K and uses_triton(x):
            return self.gemv(x.reshape(1, K)).view(*x.shape[:-1], N)
        key = (self.shape, x.dtype, x.device)
        scratch = _DEQUANT_SCRATCH.get(key)
        if scratch is None:
            scratch = _DEQUANT_SCRATCH[key] = torch.empty(self.shape, dtype=x.dtype, device=x.device)
        return F.linear(x, self.dequantize(x.dtype, out=scratch))

    def gemv(self, x: torch.Tensor, tuning: Tuning = DEFAULT, **kw) -> torch.Tensor:
        """The quantized GEMV of one row x [1, K] (accel.kernels.qgemv.qgemv_fwd, its prologue and epilogue
        keywords `kw`) -> [1, N]."""
        return qgemv_fwd(self.q, self.scale, self.low, self.bits, self.offset, self.group, self.K, x,
                         table=tuning.qgemv, pdl=tuning.qgemv_pdl.get(self.bits), **kw)

    def norm_linear(self, x, norm_weight, eps, tuning: Tuning = DEFAULT):
        """accel.ops.norm_linear: the quantized GEMV with the same RMSNorm prologue."""
        if uses_triton(x):
            return self.gemv(x, tuning, norm_weight=norm_weight, eps=eps)
        return torch_norm_linear(x, norm_weight, self.dequantize(x.dtype), eps)

    def linear_add(self, a, residual, tuning: Tuning = DEFAULT, gate=None, accumulate: bool = True):
        """accel.ops.linear_add; with a gate (a cross layer's), the GEMV's product then the gated add (the
        quantized GEMV has no gated epilogue)."""
        if uses_triton(a):
            if gate is not None:
                return gated_add(residual, self.gemv(a, tuning), gate, accumulate)
            return self.gemv(a, tuning, residual=residual if accumulate else None, out=residual)
        return torch_linear_add(a, self.dequantize(a.dtype), residual, gate, accumulate)

    def swiglu_linear_add(self, gate_up, residual, tuning: Tuning = DEFAULT, gate=None, accumulate: bool = True):
        """accel.ops.swiglu_linear_add; a gate as linear_add's."""
        if uses_triton(gate_up):
            if gate is not None:
                return gated_add(residual, self.gemv(gate_up, tuning, swiglu=True), gate, accumulate)
            return self.gemv(gate_up, tuning, swiglu=True, residual=residual if accumulate else None, out=residual)
        return torch_swiglu_linear_add(gate_up, self.dequantize(gate_up.dtype), residual, gate, accumulate)

    def norm_swiglu(self, x, norm_weight, eps, tuning: Tuning = DEFAULT):
        """swiglu_gate_up(norm_linear(x, norm_weight, self, eps)) for this gate_up [2F, D]: one kernel
        (accel.kernels.qgemv_fused.gate_up_swiglu_qfwd) for one row -> [1, F]."""
        if x.numel() == self.K and uses_triton(x):
            return gate_up_swiglu_qfwd(self.q, self.scale, self.low, self.bits, self.offset, self.group, self.K, x,
                                       norm_weight, eps, table=tuning.qgemv, pdl=tuning.qgemv_pdl.get(self.bits))
        return torch_swiglu_gate_up(torch_norm_linear(x, norm_weight, self.dequantize(x.dtype), eps))

    def norm_mlp_add(self, x, norm_weight, down, eps, tuning: Tuning = DEFAULT, accumulate: bool = True):
        """accel.ops.norm_mlp_add with this gate_up: the SwiGLU in gate_up's epilogue, then `down`'s (a matrix of
        either kind) plain GEMV with the residual add (down's SwiGLU prologue cost more instructions a code than
        any other f(x))."""
        return down.linear_add(self.norm_swiglu(x, norm_weight, eps, tuning), x, tuning, accumulate=accumulate)

    def qkv_rope(self, x, norm_weight, eps, cos, sin, position, cache_k, cache_v, tuning: Tuning = DEFAULT):
        """accel.ops.qkv_rope: one kernel (accel.kernels.qgemv_fused.qkv_rope_qfwd) for the one-token step."""
        if x.numel() == self.K and uses_triton(x):
            return qkv_rope_qfwd(self.q, self.scale, self.low, self.bits, self.offset, self.group, self.K, x,
                                 norm_weight, eps, cos, sin, position, cache_k, cache_v, table=tuning.qgemv,
                                 pdl=tuning.qgemv_pdl.get(self.bits))
        return torch_qkv_rope(x, norm_weight, self.dequantize(x.dtype), eps, cos, sin, position, cache_k, cache_v)


def cat_rows(parts: list[QuantTensor]) -> QuantTensor:
    """Stack matrices of one format along the rows (the fused qkv and gate_up)."""
    a = parts[0]
    assert all((p.fmt, p.bits, p.group, p.K, p.offset) == (a.fmt, a.bits, a.group, a.K, a.offset) for p in parts)
    low = None if a.low is None else torch.cat([p.low for p in parts])
    return QuantTensor(a.fmt, a.bits, a.group, torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                       low, a.K, a.offset)


# ---------------------------------------------------------------- quantizing on the device

def quantize(w: torch.Tensor, spec: QuantSpec) -> QuantTensor:
    """w [N, K] (any float dtype; computed in fp32) -> int8 or int4 QuantTensor, the bits of
    refimpl.quant.schemes.quantize_int8 / quantize_int4 on the same fp32 values (same ops, same order)."""
    w = w.to(torch.float32)
    N, K = w.shape
    if spec.format == "int8":
        scale = (w.abs().amax(dim=1, keepdim=True) / 127).to(torch.bfloat16).float()  # [N, 1]
        q = torch.clamp(torch.round(_divide_or_zero(w, scale)), -127, 127).to(torch.int8)
        return QuantTensor("int8", 8, K, q, scale.to(torch.bfloat16), None, K)
    G = spec.group
    pad = -K % G
    g = torch.cat([w, w[:, -1:].expand(N, pad)], dim=1).view(N, -1, G)  # [N, ceil(K/G), G], edge-padded
    lo, hi = g.amin(dim=2), g.amax(dim=2)  # [N, ceil(K/G)]
    scale = ((hi - lo) / 15).to(torch.bfloat16).float()
    low = lo.to(torch.bfloat16).float()
    q = torch.clamp(torch.round(_divide_or_zero(g - low[..., None], scale[..., None])), 0, 15).to(torch.uint8)
    q = q.view(N, -1)[:, :K].view(N, K // 2, 2)  # [N, K] -> [N, K/2, 2]
    packed = q[..., 0] | (q[..., 1] << 4)  # low nibble first
    return QuantTensor("int4", 4, G, packed.contiguous(), scale.to(torch.bfloat16), low.to(torch.bfloat16), K)


def _divide_or_zero(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    return torch.where(den == 0, torch.zeros_like(num), num / torch.where(den == 0, torch.ones_like(den), den))


def torch_dequantize(t: QuantTensor) -> torch.Tensor:
    """fp32 [N, K] with torch ops (the path without Triton)."""
    N, K = t.shape
    if t.bits == 8:
        codes = t.q.float()
    else:
        codes = torch.stack([t.q & 15, t.q >> 4], dim=-1).view(N, K).float() - t.offset  # [N, K/2, 2] -> [N, K]
    per_col = torch.arange(K, device=t.device) // t.group
    w = codes * t.scale.float()[:, per_col]
    return w + t.low.float()[:, per_col] if t.low is not None else w


# ---------------------------------------------------------------- from refimpl's records

def from_quantized_linear(w: QuantizedLinear, device) -> QuantTensor:
    """A refimpl QuantizedLinear (int8/int4, or GGUF blocks as stored) -> the device layout (module doc)."""
    dev = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731
    N, K = w.shape
    if w.format == "int8":
        return QuantTensor("int8", 8, K, dev(w.data), dev(w.scales).to(torch.bfloat16), None, K)
    if w.format == "int4":
        return QuantTensor("int4", 4, w.group, dev(w.data), dev(w.scales).to(torch.bfloat16),
                           dev(w.mins).to(torch.bfloat16), K)
    d, m, codes = block_fields(w.format, w.data, w.shape)  # [N, K/32, 1] fp32 (fp16 values), ..., [N, K/32, 32]
    d = d.reshape(N, -1)  # [N, K/32]
    if w.format == "q8_0":
        return QuantTensor("q8_0", 8, 32, dev(codes.reshape(N, K)), dev(d).half(), None, K)
    low = None if w.format == "q4_0" else dev(m.reshape(N, -1)).half()  # [N, K/32]
    return QuantTensor(w.format, 4, 32, dev(pack_nibbles(codes.reshape(N, K))), dev(d).half(), low, K,
                       8 if w.format == "q4_0" else 0)
