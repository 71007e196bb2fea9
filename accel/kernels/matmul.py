"""y = x @ wᵀ for a few rows of x, in Triton: the batched engine's linear layers (accel.batch), weight-streaming.

One kernel, three uses:
    matmul_fwd             a launch config per call (accel/kernels/tuning.py's MATMUL table, chosen per weight
                           shape and row bucket where it measured faster than cuBLAS): the decode step's GEMMs,
                           [B, K] activations against [N, K] weights, B = 1..256;
    swiglu_matmul_fwd      the fused gate_up GEMM with SwiGLU in its epilogue (tuning.py's SWIGLU_MATMUL): a
                           program owns gate rows [n0, n0 + BN) and the matching up rows [F + n0, ...) of the [2F, D]
                           weight as loaded, in two accumulators, and stores silu(gate) · up [B, F]: one launch and
                           no [B, 2F] round trip, bit for bit the GEMM then accel/kernels/swiglu.py with the config;
    invariant_matmul_fwd   one config for every row count: the batch-invariant mode's linear layers (and
                           invariant_swiglu_matmul_fwd its gate_up + SwiGLU).
A program owns BLOCK_N rows of w (as stored: [N, K], K contiguous) and BLOCK_M rows of x, and walks its K slice in
BLOCK_K steps through a STAGES-deep software pipeline: acc [BLOCK_N, BLOCK_M] += w_tile @ x_tileᵀ. The weight rows
take the tensor core's M side (64 a warpgroup on sm_90), the few activation rows its narrow N side, so a 16-row x
wastes no 64-row MMA half. With SPLIT_K slices a row block, each slice's fp32 partial goes to a scratch and the last
program of the tile to arrive sums the slices in slice order (deterministic) and stores (under SwiGLU: sums both
halves' partials, then the epilogue): small-N weights (o, down) then still spread over every SM.

Batch invariance: cuBLAS picks its kernel (tile shape, split-K) by the problem's shape, so a row's products change
with how many rows share the call. invariant_matmul_fwd always launches the same tiles and no split: an output
element's reduction order depends on K alone, so a row's result is the same bits whatever else is in the batch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import split_scratch
from .flash_attn import dot_precision
from .swiglu import silu_mul
from .tuning import MatmulConfig

# the batch-invariant mode's tiles, never chosen by the row count (CPU: big tiles, fewer interpreted programs)
INVARIANT = MatmulConfig(64, 64, 64, 1, 4, 3)
INVARIANT_CPU = MatmulConfig(16, 32, 16, 1, 4, 1)


@triton.jit
def _matmul_kernel(X, W, Y, P, CNT, M, N, K, sx_m, sw_n, sy_m, slice_k, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr,
                   STAGES: tl.constexpr, DOT_PRECISION: tl.constexpr, SWIGLU: tl.constexpr = False):
    """Program (m block, n block, K slice s) of a (M / BM, N / BN, slices) grid (the m blocks of a weight tile
    launch side by side: its second read comes from the L2); slice s covers K columns [s·slice_k, (s + 1)·slice_k).
    SWIGLU: W is a fused [2N, K] gate_up, the program's gate rows n and up rows N + n go to two accumulators and Y
    [M, N] gets silu(gate) · up."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    s = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    # rows past N (M) re-read row N-1 (M-1) instead of masking: the loads stay unmasked vectors, the stores are masked
    w_rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    x_rows = tl.minimum(offs_m, M - 1).to(tl.int64)
    k_lo = s * slice_k
    k_hi = tl.minimum(K, k_lo + slice_k)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)  # SWIGLU only
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
        w_ptrs = W + w_rows[:, None] * sw_n + (k0 + offs_k)[None, :]
        x_ptrs = X + x_rows[:, None] * sx_m + (k0 + offs_k)[None, :]
        up_ptrs = w_ptrs + N * sw_n
        if EVEN_K:
            w = tl.load(w_ptrs)  # [BN, BK]
            x = tl.load(x_ptrs)  # [BM, BK]
            if SWIGLU:
                w_up = tl.load(up_ptrs)
        else:
            k_ok = (k0 + offs_k < K)[None, :]
            w = tl.load(w_ptrs, mask=k_ok, other=0.0)
            x = tl.load(x_ptrs, mask=k_ok, other=0.0)
            if SWIGLU:
                w_up = tl.load(up_ptrs, mask=k_ok, other=0.0)
        acc = tl.dot(w, tl.trans(x), acc, input_precision=DOT_PRECISION)  # += [BN, BK] @ [BK, BM]
        if SWIGLU:
            acc_up = tl.dot(w_up, tl.trans(x), acc_up, input_precision=DOT_PRECISION)
    ok = (offs_n < N)[:, None] & (offs_m < M)[None, :]
    y_ptrs = Y + offs_m[None, :] * sy_m + offs_n[:, None]  # acc[n, m] -> y[m, n]
    if SPLIT:
        NP = 2 * N if SWIGLU else N  # the partials' columns: gate | up under SWIGLU
        part = P + s * M * NP + offs_m[None, :] * NP + offs_n[:, None]
        tl.store(part, acc, mask=ok)
        if SWIGLU:
            tl.store(part + N, acc_up, mask=ok)
        # the CTA barrier orders every thread's partial stores before the one acq_rel add: the last program to
        # arrive has acquired all partials (common.split_k_epilogue's pattern)
        tl.debug_barrier()
        tile = pid_n * tl.num_programs(0) + pid_m
        slices = tl.num_programs(2)
        ticket = tl.atomic_add(CNT + tile, 1, sem="acq_rel", scope="gpu")
        if ticket == slices - 1:
            total = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            total_up = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            for j in range(0, slices):
                part_j = P + j * M * NP + offs_m[None, :] * NP + offs_n[:, None]
                total += tl.load(part_j, mask=ok, other=0.0, cache_modifier=".cg")
                if SWIGLU:
                    total_up += tl.load(part_j + N, mask=ok, other=0.0, cache_modifier=".cg")
            if SWIGLU:
                tl.store(y_ptrs, silu_mul(total, total_up, Y.dtype.element_ty), mask=ok)
            else:
                tl.store(y_ptrs, total.to(Y.dtype.element_ty), mask=ok)
            tl.store(CNT + tile, 0)
    elif SWIGLU:
        tl.store(y_ptrs, silu_mul(acc, acc_up, Y.dtype.element_ty), mask=ok)
    else:
        tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=ok)


def row_bucket(M: int) -> int:
    """The row bucket a call of M rows is tuned for: the next power of two (the decode graphs pad to those)."""
    return 1 << max(0, M - 1).bit_length()


def _launch(x: torch.Tensor, w: torch.Tensor, N: int, config, swiglu: bool) -> torch.Tensor:
    cfg = MatmulConfig(*config)
    M, K = x.shape
    assert w.shape[1] == K and x.stride(1) == 1 and w.stride(1) == 1, "x [M, K], w [N, K], rows contiguous"
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return y
    tiles_k = triton.cdiv(K, cfg.block_k)
    per = triton.cdiv(tiles_k, cfg.split_k)
    split = triton.cdiv(tiles_k, per)  # slices that hold a tile (split_k may not divide the tiles)
    grid = (triton.cdiv(M, cfg.block_m), triton.cdiv(N, cfg.block_n), split)
    p, c = split_scratch(x.device, split * M * w.shape[0], grid[0] * grid[1]) if split > 1 else (y, y)
    _matmul_kernel[grid](x, w, y, p, c, M, N, K, x.stride(0), w.stride(0), y.stride(0), per * cfg.block_k,
                         BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT=split > 1,
                         EVEN_K=K % cfg.block_k == 0, STAGES=cfg.stages, DOT_PRECISION=dot_precision(x.dtype),
                         SWIGLU=swiglu, num_warps=cfg.warps, num_stages=cfg.stages)
    return y


def matmul_fwd(x: torch.Tensor, w: torch.Tensor, config: MatmulConfig | tuple) -> torch.Tensor:
    """x [M, K] @ w [N, K]ᵀ -> [M, N] in x's dtype (fp32 accumulation), launched as `config` says."""
    return _launch(x, w, w.shape[0], config, False)


def swiglu_matmul_fwd(x: torch.Tensor, gate_up: torch.Tensor, config: MatmulConfig | tuple) -> torch.Tensor:
    """x [M, K], gate_up [2F, K] (gate rows first, then up rows) -> silu(x @ gateᵀ) · (x @ upᵀ), [M, F] in x's
    dtype: bit for bit matmul_fwd(x, gate_up, config) then swiglu.swiglu_gate_up_fwd, one launch and no [M, 2F]
    round trip. config.block_n counts gate rows (a program reads 2·block_n weight rows)."""
    assert gate_up.shape[0] % 2 == 0, "gate_up [2F, K] expected"
    return _launch(x, gate_up, gate_up.shape[0] // 2, config, True)


def invariant_matmul_fwd(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w [N, K]ᵀ -> [M, N] in x's dtype, every M tiled alike (module docstring)."""
    return matmul_fwd(x, w, INVARIANT if x.is_cuda else INVARIANT_CPU)


def invariant_swiglu_matmul_fwd(x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """swiglu_matmul_fwd with the invariant tiles: bit for bit invariant_matmul_fwd then the SwiGLU kernel."""
    return swiglu_matmul_fwd(x, gate_up, INVARIANT if x.is_cuda else INVARIANT_CPU)
