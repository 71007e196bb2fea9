"""RMSNorm in Triton, with HF's casting order, and the fused residual-add + RMSNorm (and embedding + RMSNorm) of
the engine's fast path; and its backward for training.

One program normalizes one row [D] (Llama's D is 2048 or 3072: one block of the next power of two holds a row).
Casting order, as HF LlamaRMSNorm: reduce in fp32, cast the normalized row back to the input dtype, *then* multiply
by the weight (in fp32, rounded once to the output dtype, which is what torch's bf16 · bf16 product does).

Backward: dX only (the norm weights are frozen under LoRA, so no dW reduction over tokens). y = bf16(x · r) · w with
r = 1/sqrt(mean(x²) + eps); the cast is the identity for the gradient, so dx = r · (dn − x · r² · mean(dn · x)) with
dn = dy · w, all in fp32 from the forward's input (r is recomputed from the row rather than saved: one row of D
values is already in registers). One program = one row, as the forward.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import gdc_wait, launch_pdl, pdl_kw


@triton.jit
def _rms_norm_kernel(X, R, W, XSUM, Y, IDS, stride_x, stride_r, stride_xsum, stride_y, D, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK_D: tl.constexpr, GATHER: tl.constexpr = False,
                     PDL: tl.constexpr = False):
    """GATHER: row t of X is row IDS[t] (an embedding table), copied to XSUM as well (embedding + norm)."""
    if PDL:  # a programmatic dependent (common.pdl_launches): the previous kernel's output first
        gdc_wait()
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    inside = cols < D
    src = tl.load(IDS + row).to(tl.int64) if GATHER else row  # int64: row · stride may pass 2^31
    x = tl.load(X + src * stride_x + cols, mask=inside, other=0.0).to(tl.float32)  # [D]
    if GATHER:
        tl.store(XSUM + row * stride_xsum + cols, x.to(XSUM.dtype.element_ty), mask=inside)  # exact: a copy
    if HAS_RESIDUAL:
        r = tl.load(R + row * stride_r + cols, mask=inside, other=0.0).to(tl.float32)
        # round the sum to the activation dtype first: the unfused `x + r` in bf16 does, and the norm reads that
        x_sum = (x + r).to(XSUM.dtype.element_ty)
        tl.store(XSUM + row * stride_xsum + cols, x_sum, mask=inside)
        x = x_sum.to(tl.float32)
    variance = tl.sum(x * x, axis=0) / D
    normed = (x * tl.rsqrt(variance + eps)).to(X.dtype.element_ty)  # HF: cast back to the input dtype ...
    w = tl.load(W + cols, mask=inside, other=0.0).to(tl.float32)
    y = normed.to(tl.float32) * w  # ... then multiply by the weight
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=inside)


def _launch(x, residual, weight, eps, out_sum, out, ids=None):
    T, D = out.shape
    assert weight.shape == (D,) and x.stride(1) == 1 and weight.stride(0) == 1, "rows must be contiguous"
    BLOCK_D = triton.next_power_of_2(D)
    # a 2048-wide bf16 row is 4 KB: 4 warps keep 16-byte loads per thread up to D = 4096, 8 beyond
    num_warps = 4 if BLOCK_D <= 4096 else 8
    r = residual if residual is not None else x
    s = out_sum if out_sum is not None else x
    pdl = launch_pdl(x)
    _rms_norm_kernel[(T,)](x, r, weight, s, out, ids if ids is not None else x, x.stride(0), r.stride(0),
                           s.stride(0), out.stride(0), D, float(eps), HAS_RESIDUAL=residual is not None,
                           BLOCK_D=BLOCK_D, GATHER=ids is not None, num_warps=num_warps, PDL=pdl, **pdl_kw(pdl))


def rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, D] (rows contiguous), weight [D] -> [T, D] in x's dtype. `out` may be a preallocated [T, D]."""
    out = torch.empty_like(x) if out is None else out
    _launch(x, None, weight, eps, None, out)
    return out


def add_rms_norm_fwd(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                     out_sum: torch.Tensor | None = None,
                     out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [T, D] -> (x + residual, rms_norm(x + residual)), both [T, D] in x's dtype, in one pass.

    `out_sum=x` updates the residual stream in place (each program reads its row before writing it back).
    """
    assert residual.shape == x.shape and residual.stride(1) == 1
    out_sum = torch.empty_like(x) if out_sum is None else out_sum
    out = torch.empty_like(x) if out is None else out
    _launch(x, residual, weight, eps, out_sum, out)
    return out_sum, out


def embedding_rms_norm_fwd(ids: torch.Tensor, table: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T] int (device), table [V, D] (rows contiguous) -> (x = table[ids], rms_norm(x)), both [T, D] in the
    table's dtype, in one pass: the prefill's embedding and first attention norm (one launch fewer, at the start,
    where the GPU waits for the host's launches)."""
    (T,), (_, D) = ids.shape, table.shape
    x = torch.empty((T, D), dtype=table.dtype, device=table.device)
    out = torch.empty_like(x)
    _launch(table, None, weight, eps, x, out, ids=ids)
    return x, out


# ---- backward (training: accel.train) ----

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
