"""Matrix-vector product in Triton for the batch-1 decode step: y[N] = W[N, K] @ f(x)[K], fp32 accumulation.

Why not cuBLAS: its M=1 kernel tiles 64 rows per CTA, so the 1B qkv/o shapes (N = 3072/2048) run on 48/32 CTAs
of 132 SMs at 2.2 TB/s, and down (K = 8192) needs a split-K reduce launch (nvidia-h200, 2026-11-21, NOTES.md).
Here the rows are cut into blocks of BLOCK_N whole rows (no reduction across programs), dealt evenly to a
persistent grid of at most the programs that fit on the GPU at once (gemv_config says why); the decode step is
launch-bound too, so the neighbouring elementwise ops fold into the GEMV:
    PROLOGUE_NORM    f(x) = rms_norm(x, norm_weight, eps), HF's cast order (accel/kernels/rms_norm.py): every
                     program computes the rms of the 4-6 KB vector from L2, cheaper than a launch (~2.3 µs);
    PROLOGUE_SWIGLU  x = [gate | up] (the fused gate_up output, 2K long), f(x) = silu(gate)·up rounded as
                     accel/kernels/swiglu.py rounds it;
    residual         y = residual + round(W @ f(x)): the GEMV result is rounded to the dtype first, as the unfused
                     `F.linear` then `x + r` does. `out` may be `residual` (each program reads its rows first).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

PROLOGUE_NONE, PROLOGUE_NORM, PROLOGUE_SWIGLU = 0, 1, 2


@triton.jit
def _fx(X, NW, k0, cols, K, rstd, PROLOGUE: tl.constexpr, EVEN_K: tl.constexpr):
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
def _gemv_kernel(W, X, NW, R, Y, N, K, stride_w, eps, n_blocks, PROLOGUE: tl.constexpr,
                 HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """Persistent: program p owns row blocks p, p + P, p + 2P, ... (P programs) and streams their tiles
    [BLOCK_N, BLOCK_K] as one flat sequence i = (block, K chunk), the next tile always in flight."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n_k = tl.cdiv(K, BLOCK_K)
    total = tl.cdiv(n_blocks - pid, nprog) * n_k  # tiles of this program
    r_off = tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    # rows past N re-read row N-1 instead of masking, so weight loads stay unmasked 16-byte vectors (the store
    # is masked); the first tile is issued before the prologue's rms pass so that its latency overlaps it
    rows_c = tl.minimum(pid * BLOCK_N + r_off, N - 1).to(tl.int64)
    if EVEN_K:
        w_next = tl.load(W + rows_c[:, None] * stride_w + cols[None, :])
    else:
        w_next = tl.load(W + rows_c[:, None] * stride_w + cols[None, :], mask=cols[None, :] < K, other=0.0)
    rstd = 0.0
    if PROLOGUE == 1:  # once a program (a persistent program serves several row blocks)
        ss = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            xs = tl.load(X + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
            ss += xs * xs
        rstd = tl.rsqrt(tl.sum(ss, axis=0) / K + eps)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for i in range(0, total):
        blk = pid + (i // n_k) * nprog
        k0 = (i % n_k) * BLOCK_K
        w = w_next
        j = i + 1  # the next tile, loaded now and used next iteration (Triton pipelines only tl.dot operands)
        nrows = tl.minimum((pid + (j // n_k) * nprog) * BLOCK_N + r_off, N - 1).to(tl.int64)
        nk0 = (j % n_k) * BLOCK_K
        nptrs = W + nrows[:, None] * stride_w + nk0 + cols[None, :]
        # past this program's last tile the mask is all false (a limit of 0): no memory is touched
        if EVEN_K:
            w_next = tl.load(nptrs, mask=cols[None, :] < tl.where(j < total, BLOCK_K, 0), other=0.0)
        else:
            w_next = tl.load(nptrs, mask=nk0 + cols[None, :] < tl.where(j < total, K, 0), other=0.0)
        x = _fx(X, NW, k0, cols, K, rstd, PROLOGUE, EVEN_K)
        acc += w.to(tl.float32) * x[None, :]
        if k0 + BLOCK_K >= K:  # the block's last chunk: its rows are done
            rows = blk * BLOCK_N + r_off
            y = tl.sum(acc, axis=1)  # [BLOCK_N]
            if HAS_RESIDUAL:
                r = tl.load(R + tl.minimum(rows, N - 1))
                y = y.to(Y.dtype.element_ty).to(tl.float32) + r.to(tl.float32)
            tl.store(Y + rows, y.to(Y.dtype.element_ty), mask=rows < N)
            acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0


# (BLOCK_N, BLOCK_K, num_warps, programs; None = one program a row block) per (N, K): the fastest fused
# config of `accel.gemv_sweep` on nvidia-h200, 2026-11-21 10:48 UTC (accel/bench_results/
# h200-2026-11-21-v3b-gemv-sweep.json), µs a call in a graph vs the unfused cuBLAS sequence it replaces:
# 1B qkv 6.83 vs 8.17, o 4.87 vs 7.49, down 16.06 vs 17.02; 3B qkv 11.96 vs 12.36, o 7.69 vs 11.13, down 20.50
# vs 21.78. gate_up lost on both models (22.38 vs 21.22, 31.37 vs 29.07): accel.model.CUBLAS_SHAPES.
# Shapes not listed use the rule in gemv_config.
TABLE: dict[tuple[int, int], tuple[int, int, int, int | None]] = {
    (3072, 2048): (4, 2048, 8, 384), (2048, 2048): (4, 1024, 4, None), (2048, 8192): (4, 1024, 4, 512),
    (5120, 3072): (4, 1024, 4, 640), (3072, 3072): (4, 1024, 4, None), (3072, 8192): (4, 2048, 8, 384),
}


@functools.lru_cache(maxsize=None)
def gemv_config(N: int, K: int, sms: int, elem: int = 2) -> tuple[int, int, int, int | None]:
    """(BLOCK_N, BLOCK_K, num_warps, programs) for an [N, K] matrix of `elem`-byte elements on `sms` SMs.

    * BLOCK_K = 16 bytes × 32 lanes × 4 warps (1024 bf16): every warp lies along K, so the 1-D f(x) chunk is
      already in the layout the [BLOCK_N, BLOCK_K] tile broadcasts it to (with 512 columns Triton moved it
      through shared memory with a barrier every chunk: seen in the TTGIR, v3a);
    * BLOCK_N = 8: 16 KB tiles, two in flight a program (the prefetch);
    * programs: HBM at ~4.3 TB/s with ~1 µs of loaded latency needs ~32-64 KB in flight per SM; ~170 registers
      a thread fit 3 programs of 128 threads an SM, so up to 3 × sms programs, all resident at once, with the
      row blocks dealt out evenly (all programs the same number of tiles: they share the bandwidth and finish
      together; the v3a grid of one block a program left a partial last wave, and re-ran the prologue per wave).
    """
    if (N, K) in TABLE:
        return TABLE[(N, K)]
    if sms == 0:  # CPU, under TRITON_INTERPRET: its cost is per program and per op, not per byte, so one
        # program with big tiles (the engine's CPU tests ran ~7× slower with the GPU rule's many small tiles)
        return min(64, triton.next_power_of_2(N)), min(1024, triton.next_power_of_2(K)), 4, 1
    block_k = min(16 // elem * 32 * 4, triton.next_power_of_2(K))
    block_n = 8
    n_blocks = triton.cdiv(N, block_n)
    per = triton.cdiv(n_blocks, 3 * sms)
    return block_n, block_k, 4, triton.cdiv(n_blocks, per)


def gemv_fwd(weight: torch.Tensor, x: torch.Tensor, *, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
             swiglu: bool = False, residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
             config: tuple[int, int, int, int | None] | None = None) -> torch.Tensor:
    """y = [residual +] weight @ f(x), weight [N, K] (rows contiguous), x [K] or [1, K] ([2K] or [1, 2K] with
    swiglu) -> [1, N] in x's dtype (or `out`). f: rms_norm with norm_weight [K], or swiglu, or identity."""
    N, K = weight.shape
    assert weight.stride(1) == 1, "weight rows must be contiguous"
    assert not (swiglu and norm_weight is not None), "one prologue at a time"
    xv = x.reshape(-1)
    assert xv.stride(0) == 1 and xv.numel() == (2 * K if swiglu else K), "x must be contiguous [K] (swiglu: [2K])"
    if norm_weight is not None:
        assert norm_weight.shape == (K,) and norm_weight.stride(0) == 1
    out = torch.empty((1, N), dtype=x.dtype, device=x.device) if out is None else out
    assert out.numel() == N and out.reshape(-1).stride(0) == 1
    if residual is not None:
        assert residual.numel() == N and residual.reshape(-1).stride(0) == 1
    bn, bk, warps, programs = config or gemv_config(N, K, _sm_count(weight.device), weight.element_size())
    n_blocks = triton.cdiv(N, bn)
    programs = n_blocks if programs is None else min(programs, n_blocks)
    prologue = PROLOGUE_SWIGLU if swiglu else PROLOGUE_NORM if norm_weight is not None else PROLOGUE_NONE
    nw = norm_weight if norm_weight is not None else xv
    r = residual if residual is not None else out
    _gemv_kernel[(programs,)](weight, xv, nw, r, out, N, K, weight.stride(0), float(eps), n_blocks,
                              PROLOGUE=prologue, HAS_RESIDUAL=residual is not None, BLOCK_N=bn, BLOCK_K=bk,
                              EVEN_K=K % bk == 0, num_warps=warps)
    return out
