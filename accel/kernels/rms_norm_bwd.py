"""RMSNorm backward in Triton: dX only (the norm weights are frozen under LoRA, so no dW reduction over tokens).

y = bf16(x · r) · w with r = 1/sqrt(mean(x²) + eps); the cast is the identity for the gradient, so
dx = r · (dn − x · r² · mean(dn · x)) with dn = dy · w, all in fp32 from the forward's input (r is recomputed from
the row rather than saved: one row of D values is already in registers). One program = one row, as the forward.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_bwd_kernel(X, W, DY, DX, stride_x, stride_dy, stride_dx, D, eps, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    inside = cols < D
    x = tl.load(X + row * stride_x + cols, mask=inside, other=0.0).to(tl.float32)  # [D]
    dy = tl.load(DY + row * stride_dy + cols, mask=inside, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=inside, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    dn = dy * w  # gradient w.r.t. the normalized row x·r
    dx = r * (dn - x * (r * r * tl.sum(dn * x, axis=0) / D))
    tl.store(DX + row * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=inside)


def rms_norm_bwd(x: torch.Tensor, weight: torch.Tensor, eps: float, dy: torch.Tensor) -> torch.Tensor:
    """x, dy [T, D] (rows contiguous), weight [D] -> dx [T, D] in x's dtype."""
    T, D = x.shape
    assert dy.shape == x.shape and weight.shape == (D,), "x, dy [T, D] and weight [D] expected"
    assert x.stride(1) == 1 and dy.stride(1) == 1 and weight.stride(0) == 1, "rows must be contiguous"
    dx = torch.empty_like(x)
    BLOCK_D = triton.next_power_of_2(D)
    # as the forward: 4 warps keep 16-byte loads per thread up to D = 4096
    _rms_norm_bwd_kernel[(T,)](x, weight, dy, dx, x.stride(0), dy.stride(0), dx.stride(0), D, float(eps),
                               BLOCK_D=BLOCK_D, num_warps=4 if BLOCK_D <= 4096 else 8)
    return dx
