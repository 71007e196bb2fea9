"""LayerNorm (with bias) in Triton, and the fused scaled residual-add + LayerNorm of the vision encoder.

One program normalizes one row [U] (the encoder's U is 1280: one block of 2048 holds a row). Casting as torch's
fused LayerNorm on bf16: statistics, scale and shift in fp32, the result rounded once to the input dtype. The fused
variant first forms x + alpha·r in fp32 and rounds it to the activation dtype (what the unfused `torch.add(x, r,
alpha=alpha)` stores), then normalizes that rounded row, so it equals the two unfused ops.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _layer_norm_kernel(X, R, W, B, XSUM, Y, stride_x, stride_r, stride_xsum, stride_y, U, alpha, eps,
                       HAS_RESIDUAL: tl.constexpr, BLOCK_U: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_U)
    inside = cols < U
    x = tl.load(X + row * stride_x + cols, mask=inside, other=0.0).to(tl.float32)  # [U]
    if HAS_RESIDUAL:
        r = tl.load(R + row * stride_r + cols, mask=inside, other=0.0).to(tl.float32)
        x_sum = (x + alpha * r).to(XSUM.dtype.element_ty)
        tl.store(XSUM + row * stride_xsum + cols, x_sum, mask=inside)
        x = x_sum.to(tl.float32)
    mean = tl.sum(x, axis=0) / U
    centered = tl.where(inside, x - mean, 0.0)
    rstd = tl.rsqrt(tl.sum(centered * centered, axis=0) / U + eps)  # biased variance, as torch
    w = tl.load(W + cols, mask=inside, other=0.0).to(tl.float32)
    b = tl.load(B + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, (centered * rstd * w + b).to(Y.dtype.element_ty), mask=inside)


def _launch(x, residual, alpha, weight, bias, eps, out_sum, out):
    T, U = x.shape
    assert weight.shape == bias.shape == (U,) and x.stride(1) == 1 and out.stride(1) == 1, "rows must be contiguous"
    BLOCK_U = triton.next_power_of_2(U)
    r = residual if residual is not None else x
    s = out_sum if out_sum is not None else x
    _layer_norm_kernel[(T,)](x, r, weight, bias, s, out, x.stride(0), r.stride(0), s.stride(0), out.stride(0), U,
                             float(alpha), float(eps), HAS_RESIDUAL=residual is not None, BLOCK_U=BLOCK_U,
                             num_warps=4 if BLOCK_U <= 4096 else 8)


def layer_norm_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, U] (rows contiguous), weight/bias [U] -> [T, U] in x's dtype."""
    out = torch.empty_like(x)
    _launch(x, None, 1.0, weight, bias, eps, None, out)
    return out


def add_layer_norm_fwd(x: torch.Tensor, residual: torch.Tensor, alpha: float, weight: torch.Tensor,
                       bias: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [T, U] -> (x + alpha·residual, layer_norm(x + alpha·residual)), both [T, U] in x's dtype."""
    assert residual.shape == x.shape and residual.stride(1) == 1
    out_sum, out = torch.empty_like(x), torch.empty_like(x)
    _launch(x, residual, alpha, weight, bias, eps, out_sum, out)
    return out_sum, out
