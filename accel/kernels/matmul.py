"""A GEMM with one tiling for every row count, in Triton: the batch-invariant mode's linear layers (accel.batch).

cuBLAS picks its kernel (tile shape, split-K) by the problem's shape, so a row's products change with how many rows
share the call. Here every call uses the same BLOCK_M × BLOCK_N tiles and walks K in the same BLOCK_K steps into one
fp32 accumulator (no split-K): an output element's reduction order depends on K alone, so a row's result is the same
bits whatever else is in the batch. Slower than cuBLAS where cuBLAS would pick a better tile for the shape.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .flash_attn import dot_precision


@triton.jit
def _matmul_kernel(X, W, Y, M, N, K, sx_m, sw_n, sy_m, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + offs_k < K
        x = tl.load(X + offs_m[:, None] * sx_m + (k0 + offs_k)[None, :], mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0)  # [BM, BK]
        w = tl.load(W + offs_n[:, None] * sw_n + (k0 + offs_k)[None, :], mask=n_ok[:, None] & k_ok[None, :],
                    other=0.0)  # [BN, BK]
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)  # += [BM, BK] @ [BK, BN]
    tl.store(Y + offs_m[:, None] * sy_m + offs_n[None, :], acc.to(Y.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def invariant_matmul_fwd(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w [N, K]ᵀ -> [M, N] in x's dtype, every M tiled alike (module docstring)."""
    M, K = x.shape
    N = w.shape[0]
    assert w.shape[1] == K and x.stride(1) == 1 and w.stride(1) == 1
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    tile = (64, 64, 64) if x.is_cuda else (16, 16, 32)  # fixed: never chosen by M
    _matmul_kernel[(triton.cdiv(M, tile[0]), triton.cdiv(N, tile[1]))](
        x, w, y, M, N, K, x.stride(0), w.stride(0), y.stride(0), BLOCK_M=tile[0], BLOCK_N=tile[1], BLOCK_K=tile[2],
        DOT_PRECISION=dot_precision(x.dtype), num_warps=4, num_stages=3)
    return y
