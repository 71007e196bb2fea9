"""SwiGLU activation in Triton: silu(gate) · up, one pass over [T, F] (or over a fused [T, 2F] gate_up).

Rounding order as HF's LlamaMLP, `act_fn(gate_proj(x)) * up_proj(x)`: silu is computed in fp32 and rounded to the
activation dtype, then the product is computed in fp32 and rounded again (what two bf16 torch ops do).

Backward over the fused gate_up layout: y = silu(g) · u -> d[g | u] in one [T, 2F] buffer, dg = dy · u · σ(g) ·
(1 + g · (1 − σ(g))), du = dy · silu(g), in fp32 from the forward's inputs (recomputed, nothing saved but gate_up).
Writing both halves into one buffer is what the fused gate_up GEMM's backward wants as its dY; `swiglu_bwd` writes
them apart for separate gate and up GEMMs (HF's MLP).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import gdc_wait, launch_pdl, pdl_kw


@triton.jit
def silu_mul(g, u, dtype: tl.constexpr):
    """silu(g) · u -> dtype with HF's roundings, from g and u as the GEMM stores them (rounded to dtype): silu in
    fp32 rounded, the product in fp32 rounded. The SwiGLU kernel's and the fused gate_up GEMM's epilogue
    (matmul.py): one rounding order for both, so the fused kernel gives the same bits."""
    g = g.to(dtype).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dtype)  # silu, rounded like torch's silu output
    return (act.to(tl.float32) * u.to(dtype).to(tl.float32)).to(dtype)


@triton.jit
def _swiglu_kernel(G, U, Y, stride_g, stride_u, stride_y, F, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:  # a programmatic dependent (common.pdl_launches): the previous kernel's output first
        gdc_wait()
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < F
    g = tl.load(G + row * stride_g + cols, mask=inside, other=0.0)
    u = tl.load(U + row * stride_u + cols, mask=inside, other=0.0)
    tl.store(Y + row * stride_y + cols, silu_mul(g, u, Y.dtype.element_ty), mask=inside)


def _launch(gate, up, out):
    T, F = gate.shape
    assert up.shape == (T, F) and gate.stride(1) == 1 and up.stride(1) == 1 and out.stride(1) == 1
    # 1024 columns a program: 8192-wide rows give 8 programs a token, enough to fill the GPU at T >= 32
    BLOCK = min(1024, triton.next_power_of_2(F))
    pdl = launch_pdl(gate)
    _swiglu_kernel[(T, triton.cdiv(F, BLOCK))](gate, up, out, gate.stride(0), up.stride(0), out.stride(0), F,
                                               BLOCK=BLOCK, num_warps=4, PDL=pdl, **pdl_kw(pdl))
    return out


def swiglu_fwd(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """gate/up [T, F] -> silu(gate) · up, [T, F] in gate's dtype."""
    return _launch(gate, up, torch.empty_like(gate) if out is None else out)


def swiglu_gate_up_fwd(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """gate_up [T, 2F] (gate = first F columns, up = last F: one fused GEMM's output) -> [T, F]."""
    T, F2 = gate_up.shape
    F = F2 // 2
    out = torch.empty((T, F), dtype=gate_up.dtype, device=gate_up.device) if out is None else out
    return _launch(gate_up[:, :F], gate_up[:, F:], out)


# ---- backward (training: accel.train) ----

@triton.jit
def _swiglu_bwd_kernel(G, U, DY, DG, DU, stride_g, stride_u, stride_dy, stride_dg, stride_du, F,
                       BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < F
    g = tl.load(G + row * stride_g + cols, mask=inside, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + cols, mask=inside, other=0.0).to(tl.float32)
    dy = tl.load(DY + row * stride_dy + cols, mask=inside, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-g))
    dg = dy * u * sig * (1.0 + g * (1.0 - sig))
    du = dy * g * sig
    tl.store(DG + row * stride_dg + cols, dg.to(DG.dtype.element_ty), mask=inside)
    tl.store(DU + row * stride_du + cols, du.to(DU.dtype.element_ty), mask=inside)


def _launch_bwd(gate, up, dy, dgate, dup):
    T, F = gate.shape
    assert up.shape == dy.shape == (T, F), "gate, up, dy [T, F] expected"
    assert all(x.stride(1) == 1 for x in (gate, up, dy, dgate, dup)), "rows must be contiguous"
    BLOCK = min(1024, triton.next_power_of_2(F))  # as the forward: several programs a token at F = 8192
    _swiglu_bwd_kernel[(T, triton.cdiv(F, BLOCK))](gate, up, dy, dgate, dup, gate.stride(0), up.stride(0),
                                                   dy.stride(0), dgate.stride(0), dup.stride(0), F, BLOCK=BLOCK,
                                                   num_warps=4)


def swiglu_gate_up_bwd(gate_up: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2F] (the forward's input), dy [T, F] -> d gate_up [T, 2F] in gate_up's dtype."""
    F = gate_up.shape[1] // 2
    dgu = torch.empty_like(gate_up)
    _launch_bwd(gate_up[:, :F], gate_up[:, F:], dy, dgu[:, :F], dgu[:, F:])
    return dgu


def swiglu_bwd(gate: torch.Tensor, up: torch.Tensor, dy: torch.Tensor, dgate: torch.Tensor | None = None,
               dup: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """gate, up (the forward's inputs), dy [T, F] -> (d gate, d up) [T, F] each, in gate's dtype: separate
    outputs for separate gate and up GEMMs (HF's MLP), no fused buffer to copy into. The outputs may alias the
    inputs (each element is read before it is written, by the same program)."""
    dgate = torch.empty_like(gate) if dgate is None else dgate
    dup = torch.empty_like(up) if dup is None else dup
    _launch_bwd(gate, up, dy, dgate, dup)
    return dgate, dup
