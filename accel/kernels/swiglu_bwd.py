"""SwiGLU backward in Triton over the fused gate_up layout: y = silu(g) · u -> d[g | u] in one [T, 2F] buffer.

dg = dy · u · σ(g) · (1 + g · (1 − σ(g))), du = dy · silu(g), in fp32 from the forward's inputs (recomputed, nothing
saved but gate_up). Writing both halves into one buffer is what the fused gate_up GEMM's backward wants as its dY.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _swiglu_bwd_kernel(GU, DY, DGU, stride_gu, stride_dy, stride_dgu, F, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < F
    g = tl.load(GU + row * stride_gu + cols, mask=inside, other=0.0).to(tl.float32)
    u = tl.load(GU + row * stride_gu + F + cols, mask=inside, other=0.0).to(tl.float32)
    dy = tl.load(DY + row * stride_dy + cols, mask=inside, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-g))
    dg = dy * u * sig * (1.0 + g * (1.0 - sig))
    du = dy * g * sig
    tl.store(DGU + row * stride_dgu + cols, dg.to(DGU.dtype.element_ty), mask=inside)
    tl.store(DGU + row * stride_dgu + F + cols, du.to(DGU.dtype.element_ty), mask=inside)


def swiglu_gate_up_bwd(gate_up: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2F] (the forward's input), dy [T, F] -> d gate_up [T, 2F] in gate_up's dtype."""
    T, F2 = gate_up.shape
    F = F2 // 2
    assert dy.shape == (T, F) and gate_up.stride(1) == 1 and dy.stride(1) == 1, "rows must be contiguous"
    dgu = torch.empty_like(gate_up)
    BLOCK = min(1024, triton.next_power_of_2(F))  # as the forward: several programs a token at F = 8192
    _swiglu_bwd_kernel[(T, triton.cdiv(F, BLOCK))](gate_up, dy, dgu, gate_up.stride(0), dy.stride(0), dgu.stride(0),
                                                   F, BLOCK=BLOCK, num_warps=4)
    return dgu
