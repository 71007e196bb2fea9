"""Triton helpers shared by the decode-step kernels (gemv.py, qkv_rope.py): the GEMV prologue f(x), the RMSNorm
reciprocal, an unmasked-row weight tile, and the SM count the launch rules size their grids by."""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

PROLOGUE_NONE, PROLOGUE_NORM, PROLOGUE_SWIGLU = 0, 1, 2


@triton.jit
def prologue_fx(X, NW, k0, cols, K, rstd, PROLOGUE: tl.constexpr, EVEN_K: tl.constexpr):
    """f(x)[k0 : k0 + BLOCK_K] in fp32 (zeros past K)."""
    offs = k0 + cols
    inside = offs < K
    if EVEN_K:
        x = tl.load(X + offs)
    else:
        x = tl.load(X + offs, mask=inside, other=0.0)
    dt = X.dtype.element_ty
    if PROLOGUE == 1:  # HF RMSNorm: normalize in fp32, round to the dtype, times the weight, round again
        if EVEN_K:
            nw = tl.load(NW + offs)
        else:
            nw = tl.load(NW + offs, mask=inside, other=0.0)
        normed = (x.to(tl.float32) * rstd).to(dt)
        return (normed.to(tl.float32) * nw.to(tl.float32)).to(dt).to(tl.float32)
    elif PROLOGUE == 2:  # silu(gate) rounded, then the product rounded (two bf16 torch ops)
        if EVEN_K:
            u = tl.load(X + K + offs)
        else:
            u = tl.load(X + K + offs, mask=inside, other=0.0)
        g = x.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(dt)
        return (act.to(tl.float32) * u.to(tl.float32)).to(dt).to(tl.float32)
    else:
        return x.to(tl.float32)


@triton.jit
def rms_rstd(X, K, eps, K_POW2: tl.constexpr):
    """1 / rms(x[0:K]) in fp32, the whole x in one round of loads (K <= K_POW2 <= 8192: <= 32 values a thread)."""
    kk = tl.arange(0, K_POW2)
    xs = tl.load(X + kk, mask=kk < K, other=0.0).to(tl.float32)
    return tl.rsqrt(tl.sum(xs * xs, axis=0) / K + eps)


@triton.jit
def row_tile(W, rows_c, stride_w, k0, cols, K, EVEN_K: tl.constexpr):
    """W[rows_c, k0 : k0 + BK] ([BN, BK], zeros past K)."""
    ptrs = W + rows_c[:, None] * stride_w + k0 + cols[None, :]
    if EVEN_K:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=k0 + cols[None, :] < K, other=0.0)


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0
