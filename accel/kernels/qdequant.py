"""Quantized weights for the prefill, in Triton: dequantize a whole matrix (or a layer's), for cuBLAS to multiply by.

The quantized layout is accel/kernels/qgemv.py's (codes, a scale per GROUP columns, optional minimum, optional code
offset): W[n, k] = (Q[n, k] − OFFSET) · S[n, k // GROUP] (+ M[n, k // GROUP]), computed in fp32. Every product
code · scale is exact in fp32, so a fused multiply-add gives the same bits as the oracle's multiply then add.

    dequantize   Y [N, K] = W, rounded once to Y's dtype: a program owns a [BLOCK_N, BLOCK_K] tile; 4-bit codes
                 are split into their two nibble planes and interleaved back (tl.join) so that the tile is stored
                 contiguously, and the scales (minima) are loaded once a group and broadcast over it.
    dequantize_layer  the same for several matrices of one format in one launch (a prefill layer's, laid out at
                 load by accel.quant_layers.pack_layer): a table on the device says where each matrix starts.
The engine's prefill takes dequantize_layer + cuBLAS (accel.quant_layers.prefill_weights).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .common import per_row_scales
from .tuning import DEQUANT_BLOCK


@triton.jit
def _code_value(v, OFFSET: tl.constexpr):
    """int32 v in [0, 255] -> float(v − OFFSET), exactly, without an int-to-float conversion (a quarter-rate
    instruction): the bits 0x4B000000 | v are the float 2^23 + v, and one subtraction removes 2^23 + OFFSET."""
    return (v | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + OFFSET)


@triton.jit
def _dequant_tile(Q, S, MN, rows_c, k0, K, KB, stride_q, stride_s, n_groups, BITS: tl.constexpr,
                  OFFSET: tl.constexpr, GROUP: tl.constexpr, HAS_MIN: tl.constexpr, PER_ROW: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """W[rows_c, k0 : k0 + BLOCK_K] in fp32 ([BLOCK_N, BLOCK_K]; columns past K hold finite junk, never stored).
    rows_c: int64 row indices, already clamped inside the matrix; KB: bytes a row. k0 % BLOCK_K == 0,
    BLOCK_K % GROUP == 0 unless PER_ROW. Masks are in bytes (j < KB, not 2j < K) so that the launcher's divisibility
    hints on KB keep the code loads 16-byte vectors."""
    if BITS == 8:
        cols = k0 + tl.arange(0, BLOCK_K)
        byte = tl.load(Q + rows_c[:, None] * stride_q + cols[None, :], mask=cols[None, :] < K, other=0)
        code = _code_value(byte.to(tl.int32) + 128, OFFSET + 128)  # signed: shifted into [0, 255]
    else:
        HALF: tl.constexpr = BLOCK_K // 2
        j = k0 // 2 + tl.arange(0, HALF)  # byte columns: byte j holds columns 2j (low nibble) and 2j + 1
        byte = tl.load(Q + rows_c[:, None] * stride_q + j[None, :], mask=j[None, :] < KB, other=0).to(tl.int32)
        lo = _code_value(byte & 15, OFFSET)
        hi = _code_value(byte >> 4, OFFSET)
        code = tl.reshape(tl.join(lo, hi), [BLOCK_N, BLOCK_K])  # [BN, HALF, 2] -> [BN, BK]: columns in order
    if PER_ROW:
        s = tl.load(S + rows_c * stride_s).to(tl.float32)  # [BN]
        w = code * s[:, None]
    else:
        GB: tl.constexpr = BLOCK_K // GROUP  # groups in the tile
        g = k0 // GROUP + tl.arange(0, GB)
        g_ok = g[None, :] < n_groups
        s = tl.load(S + rows_c[:, None] * stride_s + g[None, :], mask=g_ok, other=0.0).to(tl.float32)  # [BN, GB]
        w = tl.reshape(code, [BLOCK_N, GB, GROUP]) * s[:, :, None]
        if HAS_MIN:
            m = tl.load(MN + rows_c[:, None] * stride_s + g[None, :], mask=g_ok, other=0.0).to(tl.float32)
            w += m[:, :, None]
        w = tl.reshape(w, [BLOCK_N, BLOCK_K])
    return w


@triton.jit
def _dequant_kernel(Q, S, MN, Y, N, K, KB, stride_q, stride_s, stride_y, n_groups, BITS: tl.constexpr,
                    OFFSET: tl.constexpr, GROUP: tl.constexpr, HAS_MIN: tl.constexpr, PER_ROW: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    cols = k0 + tl.arange(0, BLOCK_K)
    rows_c = tl.minimum(rows, N - 1).to(tl.int64)  # rows past N re-read row N-1; the store is masked
    w = _dequant_tile(Q, S, MN, rows_c, k0, K, KB, stride_q, stride_s, n_groups, BITS, OFFSET, GROUP, HAS_MIN, PER_ROW,
                      BLOCK_N, BLOCK_K)
    tl.store(Y + rows_c[:, None] * stride_y + cols[None, :], w.to(Y.dtype.element_ty),
             mask=(rows < N)[:, None] & (cols < K)[None, :])


# The columns of a dequantize_layer table row (int64): where a matrix's codes, scales (and minima) and output start
# in their flat buffers (elements), its shape, the bytes of codes a row, the groups a row, its first program.
LAYER_FIELDS = ("codes_at", "scales_at", "out_at", "rows", "columns", "row_bytes", "groups", "first_program")


@triton.jit
def _dequant_layer_kernel(Q, S, MN, Y, TABLE, N_MAT: tl.constexpr, BITS: tl.constexpr, OFFSET: tl.constexpr,
                          GROUP: tl.constexpr, HAS_MIN: tl.constexpr, PER_ROW: tl.constexpr, ALIGNED: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """_dequant_kernel for N_MAT matrices of one format in flat buffers: program p finds its matrix in TABLE
    ([N_MAT, 8], LAYER_FIELDS; programs in matrix order), then its tile. ALIGNED: every offset and row length is a
    multiple of 16 and every group count of 8 (what Triton's divisibility hints tell _dequant_kernel from its
    arguments), so that the code and scale loads and the stores stay 16-byte vectors."""
    pid = tl.program_id(0)
    m = 0
    for i in tl.static_range(1, N_MAT):
        m = tl.where(pid >= tl.load(TABLE + i * 8 + 7), i, m)
    row = TABLE + m * 8
    q_at, s_at, y_at = tl.load(row), tl.load(row + 1), tl.load(row + 2)
    N, K, KB, n_groups = tl.load(row + 3), tl.load(row + 4), tl.load(row + 5), tl.load(row + 6)
    if ALIGNED:
        q_at, s_at, y_at = tl.multiple_of(q_at, 16), tl.multiple_of(s_at, 16), tl.multiple_of(y_at, 16)
        K, KB = tl.multiple_of(K, 16), tl.multiple_of(KB, 16)
        if not PER_ROW:  # one scale a row has n_groups 1
            n_groups = tl.multiple_of(n_groups, 8)
    local = pid - tl.load(row + 7)
    k_blocks = tl.cdiv(K, BLOCK_K)
    rows = (local // k_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = (local % k_blocks) * BLOCK_K
    cols = k0 + tl.arange(0, BLOCK_K)
    rows_c = tl.minimum(rows, N - 1).to(tl.int64)
    w = _dequant_tile(Q + q_at, S + s_at, MN + s_at, rows_c, k0, K, KB, KB, n_groups, n_groups, BITS, OFFSET, GROUP,
                      HAS_MIN, PER_ROW, BLOCK_N, BLOCK_K)
    tl.store(Y + y_at + rows_c[:, None] * K + cols[None, :], w.to(Y.dtype.element_ty),
             mask=(rows < N)[:, None] & (cols < K)[None, :])


def _block_k(want: int, group: int, K: int, per_row: bool) -> int:
    """A tile width holding whole groups, no wider than K needs."""
    bk = min(want, max(16, triton.next_power_of_2(K)))
    return bk if per_row else max(bk, group)


def dequantize_fwd(q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor | None, bits: int, offset: int,
                   group: int, K: int, out: torch.Tensor, block: tuple[int, int, int] | None = None) -> torch.Tensor:
    """out [N, K] (any float dtype, rows contiguous) = the dequantized W, each value rounded once.
    block: (BLOCK_N, BLOCK_K, warps), for sweeps; default 16 rows × 512 columns (int4: 256 bytes of codes, 16 KB of
    bf16 out a program), 4 warps."""
    N = q.shape[0]
    assert q.stride(1) == 1 and out.stride(1) == 1 and (low is None or low.stride() == scale.stride())
    per_row = per_row_scales(group, K, low)
    if block is None:
        block = DEQUANT_BLOCK if q.is_cuda else (min(32, triton.next_power_of_2(N)), 256, 4)
    bn, bk, warps = block
    bk = _block_k(bk, group, K, per_row)
    _dequant_kernel[(triton.cdiv(N, bn), triton.cdiv(K, bk))](
        q, scale, low if low is not None else scale, out, N, K, q.shape[1], q.stride(0), scale.stride(0), out.stride(0),
        scale.shape[1], BITS=bits, OFFSET=offset, GROUP=group, HAS_MIN=low is not None, PER_ROW=per_row,
        BLOCK_N=bn, BLOCK_K=bk, num_warps=warps)
    return out


class LayerDequant(NamedTuple):
    """One dequantize_layer_fwd launch, prepared once at load (accel.quant_layers.pack_layer): matrices of one format
    whose codes, scales and minima sit in three flat buffers, described by `table` ([M, 8] int64, LAYER_FIELDS)."""
    q: torch.Tensor
    scale: torch.Tensor
    low: torch.Tensor  # the scales again when the format has no minima (an unused argument)
    table: torch.Tensor
    grid: tuple[int]
    meta: dict  # the kernel's constexprs and num_warps


def layer_block(on_gpu: bool, group: int, per_row: bool) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, warps) of a dequantize_layer launch: dequantize_fwd's GPU tile; smaller under the
    interpreter. The tile holds whole groups."""
    bn, bk, warps = DEQUANT_BLOCK if on_gpu else (16, 128, 4)
    return bn, bk if per_row else max(bk, group), warps


def layer_launch(q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor | None, rows: list[tuple[int, ...]],
                 bits: int, offset: int, group: int, per_row: bool) -> LayerDequant:
    """rows: a (codes_at, scales_at, out_at, N, K, row_bytes, groups) tuple a matrix -> the launch over all of
    them, one program a [BLOCK_N, BLOCK_K] tile of each."""
    bn, bk, warps = layer_block(q.is_cuda, group, per_row)
    table, first = [], 0
    for r in rows:
        table.append(list(r) + [first])
        first += triton.cdiv(r[3], bn) * triton.cdiv(r[4], bk)
    aligned = all(r[0] % 16 == 0 and r[1] % 16 == 0 and r[2] % 16 == 0 and r[4] % 16 == 0 and r[5] % 16 == 0
                  and (per_row or r[6] % 8 == 0) for r in rows)
    meta = dict(N_MAT=len(rows), BITS=bits, OFFSET=offset, GROUP=bk if per_row else group, HAS_MIN=low is not None,
                PER_ROW=per_row, ALIGNED=aligned, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps)
    return LayerDequant(q, scale, low if low is not None else scale,
                        torch.tensor(table, dtype=torch.int64, device=q.device), (first,), meta)


def dequantize_layer_fwd(launch: LayerDequant, out: torch.Tensor) -> torch.Tensor:
    """Dequantize every matrix of `launch` into the flat `out` (its out_at offsets), each value rounded once to
    out's dtype, in one launch."""
    _dequant_layer_kernel[launch.grid](launch.q, launch.scale, launch.low, out, launch.table, **launch.meta)
    return out
