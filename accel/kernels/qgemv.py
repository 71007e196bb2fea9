"""Weight-only quantized matrix-vector product in Triton: the decode step (the prefill: kernels/qdequant.py).

A quantized matrix W [N, K] arrives as (accel.quant_ops.QuantTensor):
    Q  int8 [N, K] (BITS 8) or uint8 [N, K/2] (BITS 4: byte j = code 2j | code 2j+1 << 4)
    S  [N, ceil(K/GROUP)] scales, M the same shape of minima (HAS_MIN) or none; any float dtype, read as fp32
    W[n, k] = (Q[n, k] − OFFSET) · S[n, k // GROUP] (+ M[n, k // GROUP])   (OFFSET 8 for GGUF's Q4_0, else 0)
That covers int8 per row (GROUP = K), int4 in groups (GROUP 32/64/128) and GGUF's Q8_0 / Q4_0 / Q4_1 (GROUP 32,
their blocks rearranged at load). The GEMV never forms W: within a group it sums Q·f(x) and Σ f(x) in fp32, then
y += S·Σ Q·f(x) + M·Σ f(x) — the same value as multiplying by the dequantized W, up to fp32 summation order.
The prologues (RMSNorm, SwiGLU) and the residual epilogue are accel/kernels/common.py's (as gemv.py's), so the decode step's
fusions carry over unchanged; a program multiplies a row block over one K slice and, with SPLIT_K > 1, the
row block's last program to arrive sums the slices in order (gemv.py's split kernel does the same).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .common import (PROLOGUE_NONE, PROLOGUE_NORM, PROLOGUE_SWIGLU, prologue_fx, rms_rstd, sm_count,
                     split_k_epilogue, split_scratch)


@triton.jit
def _code_value(v, OFFSET: tl.constexpr):
    """int32 v in [0, 255] -> float(v − OFFSET), exactly, without an int-to-float conversion (a quarter-rate
    instruction, which would bound the 4-bit GEMV below the memory bandwidth): the bits 0x4B000000 | v are the
    float 2^23 + v, and one subtraction removes 2^23 + OFFSET."""
    return (v | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + OFFSET)


@triton.jit
def _codes(byte, half, BITS: tl.constexpr, OFFSET: tl.constexpr):
    """The codes of a tile of bytes as fp32, minus OFFSET: the int8 itself, or the low (half 0) / high nibble."""
    if BITS == 8:
        v = _code_value(byte.to(tl.int32) + 128, OFFSET + 128)  # signed: shifted into [0, 255]
    else:
        v = _code_value((byte.to(tl.int32) >> (4 * half)) & 15, OFFSET)
    return v


@triton.jit
def _codes_times_x(Q, X, NW, rows_c, kb0, j, K, KB, stride_q, rstd, BITS: tl.constexpr, OFFSET: tl.constexpr,
                   PROLOGUE: tl.constexpr):
    """-> (Q·f(x) [BN, BYTES] summed per byte, f(x) summed per byte [BYTES]) for the tile at byte column kb0
    (KB bytes a row). Indexing and masking in bytes, not columns, keeps the loads 16-byte vectors."""
    PACK: tl.constexpr = 8 // BITS
    k0 = kb0 * PACK
    byte = tl.load(Q + rows_c[:, None] * stride_q + kb0 + j[None, :], mask=kb0 + j[None, :] < KB, other=0)
    if BITS == 8:
        xs = prologue_fx(X, NW, k0, j, K, rstd, PROLOGUE, False)  # [BYTES] fp32, zeros past K
        prod = _codes(byte, 0, BITS, OFFSET) * xs[None, :]
    else:
        xe = prologue_fx(X, NW, k0, 2 * j, K, rstd, PROLOGUE, False)  # f(x) at the even columns (low nibbles)
        xo = prologue_fx(X, NW, k0, 2 * j + 1, K, rstd, PROLOGUE, False)
        prod = _codes(byte, 0, BITS, OFFSET) * xe[None, :] + _codes(byte, 1, BITS, OFFSET) * xo[None, :]
        xs = xe + xo
    return prod, xs  # (one return: Triton compiles the code after a constexpr-if's return too)


@triton.jit
def _qtile(Q, S, M, X, NW, rows_c, kb0, j, K, KB, stride_q, stride_s, rstd, n_groups, BITS: tl.constexpr,
           OFFSET: tl.constexpr, GROUP: tl.constexpr, HAS_MIN: tl.constexpr, PER_ROW: tl.constexpr,
           PROLOGUE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Σ_k W[rows, k0 + k] · f(x)[k0 + k] over one [BLOCK_N, BLOCK_K] tile at byte column kb0 = k0·BITS/8
    -> [BLOCK_N] fp32 (PER_ROW: unscaled)."""
    prod, xs = _codes_times_x(Q, X, NW, rows_c, kb0, j, K, KB, stride_q, rstd, BITS, OFFSET, PROLOGUE)
    if PER_ROW:
        out = tl.sum(prod, axis=1)
    else:
        GB: tl.constexpr = BLOCK_K // GROUP  # groups in the tile
        GP: tl.constexpr = GROUP * BITS // 8  # bytes a group
        inner = tl.sum(tl.reshape(prod, [BLOCK_N, GB, GP]), axis=2)  # [BN, GB]
        g = kb0 // GP + tl.arange(0, GB)
        s = tl.load(S + rows_c[:, None] * stride_s + g[None, :], mask=g[None, :] < n_groups, other=0.0)
        out = tl.sum(inner * s.to(tl.float32), axis=1)
        if HAS_MIN:
            xg = tl.sum(tl.reshape(xs, [GB, GP]), axis=1)  # [GB]: Σ f(x) a group
            m = tl.load(M + rows_c[:, None] * stride_s + g[None, :], mask=g[None, :] < n_groups, other=0.0)
            out += tl.sum(m.to(tl.float32) * xg[None, :], axis=1)
    return out


@triton.jit
def _qgemv_kernel(Q, S, M, X, NW, R, Y, P, CNT, N, K, KB, stride_q, stride_s, eps, n_groups, kb_split,
                  BITS: tl.constexpr, OFFSET: tl.constexpr, GROUP: tl.constexpr, HAS_MIN: tl.constexpr,
                  PER_ROW: tl.constexpr, PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, K_POW2: tl.constexpr, SPLIT_K: tl.constexpr, STAGES: tl.constexpr):
    """Program (row block b, K slice s): rows b·BN .. (b+1)·BN over bytes s·kb_split .. (s+1)·kb_split of Q."""
    b = tl.program_id(0)
    sp = tl.program_id(1)
    rows = b * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_c = tl.minimum(rows, N - 1).to(tl.int64)  # rows past N re-read row N-1; the stores are masked
    BYTES: tl.constexpr = BLOCK_K * BITS // 8
    j = tl.arange(0, BYTES)
    rstd = 0.0
    if PROLOGUE == 1:
        rstd = rms_rstd(X, K, eps, K_POW2)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    kb_lo = sp * kb_split
    kb_hi = tl.minimum(kb_lo + kb_split, KB)
    for kb0 in tl.range(kb_lo, kb_hi, BYTES, num_stages=STAGES):
        acc += _qtile(Q, S, M, X, NW, rows_c, kb0, j, K, KB, stride_q, stride_s, rstd, n_groups, BITS, OFFSET, GROUP,
                      HAS_MIN, PER_ROW, PROLOGUE, BLOCK_N, BLOCK_K)
    if PER_ROW:
        acc *= tl.load(S + rows_c * stride_s).to(tl.float32)
    split_k_epilogue(acc, P, CNT, R, Y, rows, N, sp, b, SPLIT_K, HAS_RESIDUAL)


class QGemvConfig(NamedTuple):
    block_n: int
    block_k: int
    warps: int
    split_k: int
    stages: int


@functools.lru_cache(maxsize=None)
def qgemv_config(N: int, K: int, bits: int, group: int, sms: int) -> QGemvConfig:
    """512 bytes of a row a tile (16 B a lane of a warp); row blocks × K slices ≈ 4 programs an SM, each slice a
    whole number of tiles. On CPU (the interpreter, whose cost is per program and per op): one big-tile program."""
    per_row = group >= K and bits == 8
    if sms == 0:
        bk = max(min(1024, triton.next_power_of_2(K)), 1 if per_row else group)
        return QGemvConfig(min(32, triton.next_power_of_2(N)), bk, 4, 1, 1)
    bk = max(512 * 8 // bits, 1 if per_row else group)
    bn = 16
    blocks = triton.cdiv(N, bn)
    tiles = triton.cdiv(K, bk)
    split = 1
    while blocks * split * 2 <= 4 * sms and tiles % (split * 2) == 0:
        split *= 2
    return QGemvConfig(bn, bk, 4, split, 3)


def qgemv_fwd(q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor | None, bits: int, offset: int, group: int,
              K: int, x: torch.Tensor, *, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
              swiglu: bool = False, residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
              config: QGemvConfig | tuple | None = None) -> torch.Tensor:
    """y = [residual +] W @ f(x) for the quantized W [N, K] (module doc), x [K] or [1, K] ([2K] with swiglu)
    -> [1, N] in x's dtype (or `out`); f and the epilogue as accel.kernels.gemv.gemv_fwd."""
    N = q.shape[0]
    assert q.stride(1) == 1 and scale.stride(1) == 1 and (low is None or low.stride() == scale.stride())
    xv = x.reshape(-1)
    assert xv.stride(0) == 1 and xv.numel() == (2 * K if swiglu else K), "x must be contiguous [K] (swiglu: [2K])"
    assert not (swiglu and norm_weight is not None), "one prologue at a time"
    out = torch.empty((1, N), dtype=x.dtype, device=x.device) if out is None else out
    per_row = group >= K and low is None  # one scale a row, applied after the sum (with minima: the group path)
    cfg = QGemvConfig(*config) if config is not None else qgemv_config(N, K, bits, group, sm_count(q.device))
    assert per_row or cfg.block_k % group == 0, "a tile holds whole groups"
    prologue = PROLOGUE_SWIGLU if swiglu else PROLOGUE_NORM if norm_weight is not None else PROLOGUE_NONE
    blocks = triton.cdiv(N, cfg.block_n)
    k_split = triton.cdiv(triton.cdiv(K, cfg.split_k), cfg.block_k) * cfg.block_k
    split = triton.cdiv(K, k_split)
    pack = 8 // bits
    p, c = split_scratch(q.device, split * N, blocks) if split > 1 else (out, out)
    _qgemv_kernel[(blocks, split)](
        q, scale, low if low is not None else scale, xv, norm_weight if norm_weight is not None else xv,
        residual if residual is not None else out, out, p, c, N, K, triton.cdiv(K, pack), q.stride(0),
        scale.stride(0), float(eps), scale.shape[1], k_split // pack, BITS=bits, OFFSET=offset, GROUP=group,
        HAS_MIN=low is not None, PER_ROW=per_row, PROLOGUE=prologue, HAS_RESIDUAL=residual is not None,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        K_POW2=triton.next_power_of_2(K) if prologue == PROLOGUE_NORM else 1, SPLIT_K=split, STAGES=cfg.stages,
        num_warps=cfg.warps, num_stages=cfg.stages)
    return out

