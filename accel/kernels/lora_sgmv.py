"""Segmented multi-LoRA product in Triton (Punica's SGMV, S-LoRA): many adapters, unmerged, in one batch.

    y[t] += scale[a_t] · (x[t] @ A[a_t]ᵀ) @ B[a_t]ᵀ      for every row t with an adapter (a_t >= 0)

A [N, R, Din] and B [N, Dout, R] hold N adapters stacked, each rank zero-padded to R (padded rows of A and columns
of B are zero, so they add nothing). The rows come as tiles: (first row, end row, adapter), at most BLOCK_M rows of
one adapter each (`segment_tiles` builds them from an adapter index per row; rows of one adapter need not be
contiguous, but contiguous ones share tiles). Two launches, as Punica's shrink and expand:
    shrink  program (tile):          v[rows] = x[rows] @ A[a]ᵀ                [M, Din] @ [Din, R] -> [M, R]
    expand  program (tile, n block): y[rows, n] += scale[a] · v[rows] @ B[a, n]ᵀ   [M, R] @ [R, BN] -> [M, BN]
v is rounded to the weights' dtype between the two (as the two chained F.linear of a PEFT layer do); both products
accumulate in fp32 and y is rounded once, after the add. Tiles never share a row, so the stores do not race.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .flash_attn import dot_precision

BLOCK_M = 16  # rows a tile (tl.dot's minimum)
BLOCK_K = 64
BLOCK_N = 64


@triton.jit
def _shrink_kernel(X, A, V, TILES, Din, R, stride_x, stride_an, stride_ar, stride_v,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    t = tl.program_id(0)
    start = tl.load(TILES + 3 * t)
    end = tl.load(TILES + 3 * t + 1)
    a = tl.load(TILES + 3 * t + 2).to(tl.int64)
    rows = start + tl.arange(0, BLOCK_M)
    ranks = tl.arange(0, BLOCK_R)
    row_ok = rows < end
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, Din, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < Din
        x = tl.load(X + rows[:, None].to(tl.int64) * stride_x + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)  # [BM, BK]
        w = tl.load(A + a * stride_an + ranks[None, :] * stride_ar + ks[:, None],
                    mask=(ranks[None, :] < R) & k_ok[:, None], other=0.0)  # [BK, BR]: A[a]ᵀ's tile
        acc += tl.dot(x, w, input_precision=DOT_PRECISION)  # [BM, BK] @ [BK, BR] -> [BM, BR]
    tl.store(V + rows[:, None].to(tl.int64) * stride_v + ranks[None, :], acc.to(V.dtype.element_ty),
             mask=row_ok[:, None] & (ranks[None, :] < R))


@triton.jit
def _expand_kernel(V, B, Y, S, TILES, Dout, R, stride_v, stride_bn, stride_bo, stride_y,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    t = tl.program_id(0)
    nb = tl.program_id(1)
    start = tl.load(TILES + 3 * t)
    end = tl.load(TILES + 3 * t + 1)
    a = tl.load(TILES + 3 * t + 2).to(tl.int64)
    rows = start + tl.arange(0, BLOCK_M)
    ranks = tl.arange(0, BLOCK_R)
    cols = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < end
    col_ok = cols < Dout
    v = tl.load(V + rows[:, None].to(tl.int64) * stride_v + ranks[None, :],
                mask=row_ok[:, None] & (ranks[None, :] < R), other=0.0)  # [BM, BR]
    b = tl.load(B + a * stride_bn + cols[None, :].to(tl.int64) * stride_bo + ranks[:, None],
                mask=col_ok[None, :] & (ranks[:, None] < R), other=0.0)  # [BR, BN]: B[a]ᵀ's tile
    delta = tl.dot(v, b, input_precision=DOT_PRECISION)  # [BM, BR] @ [BR, BN] -> [BM, BN]
    scale = tl.load(S + a)
    ptrs = Y + rows[:, None].to(tl.int64) * stride_y + cols[None, :]
    ok = row_ok[:, None] & col_ok[None, :]
    y = tl.load(ptrs, mask=ok, other=0.0).to(tl.float32)
    tl.store(ptrs, (y + scale * delta).to(Y.dtype.element_ty), mask=ok)


def segment_tiles(adapter_per_row, block_m: int = BLOCK_M) -> list[tuple[int, int, int]]:
    """Adapter index per row (a list; -1: no adapter) -> tiles (first row, end row, adapter): each run of equal
    indices cut into pieces of at most block_m rows; rows without an adapter get none."""
    tiles, t, n = [], 0, len(adapter_per_row)
    while t < n:
        a, end = adapter_per_row[t], t + 1
        while end < n and adapter_per_row[end] == a:
            end += 1
        if a >= 0:
            tiles += [(s, min(s + block_m, end), a) for s in range(t, end, block_m)]
        t = end
    return tiles


def tiles_tensor(tiles, device) -> torch.Tensor:
    """segment_tiles' list -> [NT, 3] int32 on the device (a step builds it once for all its layers)."""
    return torch.tensor(tiles, dtype=torch.int32, device=device).reshape(len(tiles), 3)


def lora_sgmv_fwd(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                  scales: torch.Tensor, tiles: torch.Tensor) -> torch.Tensor:
    """y [T, Dout] += per-row LoRA of x [T, Din] (in place; returns y). lora_a [N, R, Din], lora_b [N, Dout, R]
    (x's dtype, unit stride on the last dimension), scales [N] fp32, tiles [NT, 3] int32 from tiles_tensor."""
    T, Din = x.shape
    N, R, _ = lora_a.shape
    Dout = lora_b.shape[1]
    if tiles.shape[0] == 0:
        return y
    v = torch.empty(T, R, dtype=lora_a.dtype, device=x.device)  # [T, R]: rows without a tile stay unwritten
    block_r = max(16, triton.next_power_of_2(R))
    precision = dot_precision(x.dtype)
    _shrink_kernel[(tiles.shape[0],)](x, lora_a, v, tiles, Din, R, x.stride(0), lora_a.stride(0), lora_a.stride(1),
                                      v.stride(0), BLOCK_M=BLOCK_M, BLOCK_R=block_r, BLOCK_K=BLOCK_K,
                                      DOT_PRECISION=precision)
    grid = (tiles.shape[0], triton.cdiv(Dout, BLOCK_N))
    _expand_kernel[grid](v, lora_b, y, scales, tiles, Dout, R, v.stride(0), lora_b.stride(0), lora_b.stride(1),
                         y.stride(0), BLOCK_M=BLOCK_M, BLOCK_R=block_r, BLOCK_N=BLOCK_N, DOT_PRECISION=precision)
    return y
