"""Weight-only quantized weights on the device: the QuantTensor record, quantizing on the device (bit for bit
refimpl.quant's oracle), converting refimpl's QuantizedLinear records, and the quantized versions of the decode
step's fused GEMV ops (accel.ops.fused sends a QuantTensor weight here). Loading a model's quantized layers and
packing them for the prefill: accel/quant_layers.py.

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
instead of four, which is what the host pays for (tools/bench/NOTES.md). Measured alternatives, for benchmarks:
`prefill_path("dequant")`, a launch and a scratch per matrix (quant_linear), and `prefill_path("gemm")`, qdequant's
GEMM that dequantizes in registers (reading only the codes): slower at every row count of 16-2048 but one
(NOTES.md, "quantized prefill").
"""
from __future__ import annotations

from dataclasses import dataclass

import contextvars

import numpy as np
import torch
import torch.nn.functional as F

from refimpl.quant.schemes import QuantizedLinear, QuantSpec, pack_nibbles
from refimpl.quant.gguf_blocks import block_fields

from . import ops
from .kernels.common import setting
from .ops.torch_ops import torch_linear_add, torch_norm_linear, torch_swiglu_linear_add, unfused_qkv_rope


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
        if ops.uses_triton(self.q):
            from .kernels.qdequant import dequantize_fwd
            return dequantize_fwd(self.q, self.scale, self.low, self.bits, self.offset, self.group, self.K, out)
        return out.copy_(torch_dequantize(self))

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is not F.linear:
            return NotImplemented
        x, weight = args[0], args[1]
        return quant_linear(x, weight)


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


# ---------------------------------------------------------------- the products

_DEQUANT_SCRATCH: dict[tuple, torch.Tensor] = {}
_PREFILL_PATH = contextvars.ContextVar("accel_quant_prefill_path", default=None)
_DECODE_PDL = contextvars.ContextVar("accel_quant_decode_pdl", default="default")  # the kernels' own default
# the decode MLP's SwiGLU in gate_up's epilogue (True) or in down's prologue (False): quant_norm_mlp_add
_SWIGLU_IN_GATE_UP = contextvars.ContextVar("accel_quant_swiglu_in_gate_up", default=True)


# the one-token MLP as one chained launch (accel/kernels/qmlp.py): True / False, or None: where tuning.QMLP lists it
_MLP_CHAINED = contextvars.ContextVar("accel_quant_mlp_chained", default=(None, None))


def prefill_path(path: str | None):
    """Within this block, products of more than one row take `path`: "gemm" (the fused GEMM) or "dequant" (a
    scratch a matrix + cuBLAS) instead of a packed layer's one dequantize launch (None, the default:
    accel.quant_layers.prefill_weights). For benchmarks comparing them."""
    assert path in (None, "gemm", "dequant")
    return setting(_PREFILL_PATH, path)


def chosen_prefill_path() -> str | None:
    """The path prefill_path() chose here, or None."""
    return _PREFILL_PATH.get()


def decode_pdl(mode):
    """Within this block, the quantized GEMVs and qkv + RoPE launch with `mode`, an accel.kernels.qgemv.PdlMode, or
    None for plain launches. For benchmarks and tests comparing them."""
    return setting(_DECODE_PDL, mode)


def swiglu_in_gate_up(on: bool):
    """Within this block, the quantized decode MLP puts the SwiGLU in gate_up's epilogue (on) or in down's prologue
    (off). For benchmarks and tests comparing the two."""
    return setting(_SWIGLU_IN_GATE_UP, on)


def mlp_chained(on: bool | None, launch=None):
    """Within this block, the quantized one-token MLP (SwiGLU in gate_up's epilogue) runs as one chained launch
    (on), as two kernels (off) or as tuning.QMLP says (None); launch: an accel.kernels.tuning.QMlpConfig for the
    chained launch instead of the table's. For benchmarks and tests comparing them."""
    return setting(_MLP_CHAINED, (on, launch))


def _pdl_kw() -> dict:
    return dict(pdl=_DECODE_PDL.get())


def quant_linear(x: torch.Tensor, w: QuantTensor) -> torch.Tensor:
    """F.linear(x, w) for x [..., K]: the GEMV for one row, else a dequantized scratch copy and cuBLAS (or the
    fused GEMM inside prefill_path("gemm"))."""
    N, K = w.shape
    if x.numel() == K and ops.uses_triton(x):
        return qgemv(w, x.reshape(1, K)).view(*x.shape[:-1], N)
    if _PREFILL_PATH.get() == "gemm" and ops.uses_triton(x):
        from .kernels.qdequant import qgemm_fwd
        y = qgemm_fwd(x.reshape(-1, K).contiguous(), w.q, w.scale, w.low, w.bits, w.offset, w.group, K)
        return y.view(*x.shape[:-1], N)
    key = (w.shape, x.dtype, x.device)
    scratch = _DEQUANT_SCRATCH.get(key)
    if scratch is None:
        scratch = _DEQUANT_SCRATCH[key] = torch.empty(w.shape, dtype=x.dtype, device=x.device)
    return F.linear(x, w.dequantize(x.dtype, out=scratch))


def qgemv(w: QuantTensor, x, **kw) -> torch.Tensor:
    from .kernels.qgemv import qgemv_fwd
    return qgemv_fwd(w.q, w.scale, w.low, w.bits, w.offset, w.group, w.K, x, **{**_pdl_kw(), **kw})


def quant_norm_linear(x, norm_weight, w: QuantTensor, eps):
    """ops.norm_linear for a quantized weight: the quantized GEMV with the same RMSNorm prologue."""
    if ops.uses_triton(x):
        return qgemv(w, x, norm_weight=norm_weight, eps=eps)
    return torch_norm_linear(x, norm_weight, w.dequantize(x.dtype), eps)


def quant_linear_add(a, w: QuantTensor, residual):
    if ops.uses_triton(a):
        return qgemv(w, a, residual=residual, out=residual)
    return torch_linear_add(a, w.dequantize(a.dtype), residual)


def quant_attention_o_add(q, cache_k, cache_v, position, w: QuantTensor, residual, attention_options: dict):
    """ops.attention_o_add's one launch for a quantized o (accel.kernels.attn_o), with the attention's options
    and o's launch mode as the GEMV's (decode_pdl)."""
    from .kernels.attn_o import attention_o_qfwd
    return attention_o_qfwd(q, cache_k, cache_v, position, w.q, w.scale, w.low, w.bits, w.offset, w.group, w.K,
                            residual, **attention_options, o_pdl=_DECODE_PDL.get())


def quant_swiglu_linear_add(gate_up, w: QuantTensor, residual):
    if ops.uses_triton(gate_up):
        return qgemv(w, gate_up, swiglu=True, residual=residual, out=residual)
    return torch_swiglu_linear_add(gate_up, w.dequantize(gate_up.dtype), residual)


def quant_norm_swiglu(x, norm_weight, w: QuantTensor, eps):
    """swiglu_gate_up(norm_linear(x, norm_weight, w, eps)) for a quantized gate_up [2F, D]: one kernel
    (accel.kernels.qgemv_fused.gate_up_swiglu_qfwd) for one row, else the two ops -> [1, F]."""
    if x.numel() == w.K and ops.uses_triton(x):
        from .kernels.qgemv_fused import gate_up_swiglu_qfwd
        return gate_up_swiglu_qfwd(w.q, w.scale, w.low, w.bits, w.offset, w.group, w.K, x, norm_weight, eps,
                                   **_pdl_kw())
    return ops.swiglu_gate_up(quant_norm_linear(x, norm_weight, w, eps))


def quant_norm_mlp_add(x, norm_weight, gate_up: QuantTensor, down, eps):
    """ops.norm_mlp_add for quantized weights: the SwiGLU in gate_up's epilogue, then down's plain GEMV with the
    residual add (down's SwiGLU prologue cost more instructions a code than any other f(x): tools/bench/NOTES.md),
    for one token as two kernels or one chained launch (`_chained`); inside swiglu_in_gate_up(False), gate_up's norm
    GEMV then down's SwiGLU prologue."""
    if _SWIGLU_IN_GATE_UP.get():
        if x.numel() == gate_up.K and ops.uses_triton(x) and _chained(gate_up, down):
            return quant_norm_mlp_chained(x, norm_weight, gate_up, down, eps)
        return ops.linear_add(quant_norm_swiglu(x, norm_weight, gate_up, eps), down, x)
    return ops.swiglu_linear_add(quant_norm_linear(x, norm_weight, gate_up, eps), down, x)


def _chained(gate_up: QuantTensor, down: QuantTensor) -> bool:
    """Whether the one-token MLP runs chained (mlp_chained's switch, else tuning.QMLP lists gate_up's shape):
    only with both matrices in one format (the launch has one set of code constexprs)."""
    from .kernels.tuning import QMLP
    if (gate_up.bits, gate_up.offset, gate_up.low is None) != (down.bits, down.offset, down.low is None):
        return False
    on = _MLP_CHAINED.get()[0]
    return on if on is not None else (*gate_up.shape, gate_up.bits, gate_up.group) in QMLP


def quant_norm_mlp_chained(x, norm_weight, gate_up: QuantTensor, down: QuantTensor, eps):
    """quant_norm_mlp_add's one-token MLP as one launch (accel.kernels.qmlp.norm_mlp_qfwd) -> x, updated."""
    from .kernels.common import sm_count
    from .kernels.qmlp import mlp_configs, norm_mlp_qfwd
    config = mlp_configs(*gate_up.shape, down.K, gate_up.bits, gate_up.group, down.group, sm_count(x.device),
                         _MLP_CHAINED.get()[1])
    return norm_mlp_qfwd((gate_up.q, gate_up.scale, gate_up.low, gate_up.group),
                         (down.q, down.scale, down.low, down.group), gate_up.bits, gate_up.offset, x, norm_weight,
                         eps, config, **_pdl_kw())


def quant_qkv_rope(x, norm_weight, w: QuantTensor, eps, cos, sin, position, cache_k, cache_v):
    """ops.qkv_rope for a quantized weight: one kernel (accel.kernels.qgemv_fused.qkv_rope_qfwd) for the one-token
    step, else the quantized GEMV with the norm prologue, then ops.rope_kv_write."""
    if x.numel() == w.K and ops.uses_triton(x):
        from .kernels.qgemv_fused import qkv_rope_qfwd
        return qkv_rope_qfwd(w.q, w.scale, w.low, w.bits, w.offset, w.group, w.K, x, norm_weight, eps, cos, sin,
                             position, cache_k, cache_v, **_pdl_kw())
    return unfused_qkv_rope(quant_norm_linear, ops.rope_kv_write, x, norm_weight, w, eps, cos, sin, position,
                            cache_k, cache_v)
