"""Matrix-vector product in Triton for the batch-1 decode step: y[N] = W[N, K] @ f(x)[K], fp32 accumulation.

Why not cuBLAS: its M=1 kernel tiles 64 rows per CTA, so the 1B o shape (N = 2048) runs on 32 CTAs of 132 SMs,
and down (K = 8192) needs a split-K reduce launch.
Three kernels, chosen per shape by the launch table (accel/kernels/tuning.py, GemvConfig.kind):
    split    grid (row blocks, K slices): each program multiplies ONE [BLOCK_N, BLOCK_K] tile, all its weight
             loads issued at once, f(x) computed once; partials of several slices are summed in slice order by
             the row block's last program to arrive (deterministic);
    persist  row blocks of BLOCK_N whole rows dealt evenly to a persistent grid, two tiles in flight a program
             (the rule for shapes the table does not list);
    stream   persistent too, but the tiles pass through shared memory in Triton's cp.async software pipeline,
             STAGES deep, so the bytes in flight are not bounded by registers.
The decode step is launch-bound too, so the neighbouring elementwise ops fold into the GEMV:
    PROLOGUE_NORM    f(x) = rms_norm(x, norm_weight, eps), HF's cast order (accel/kernels/rms_norm.py): every
                     program computes the rms of the 4-6 KB vector from L2, cheaper than a launch;
    PROLOGUE_SWIGLU  x = [gate | up] (the fused gate_up output, 2K long), f(x) = silu(gate)·up rounded as
                     accel/kernels/swiglu.py rounds it;
    residual         y = residual + round(W @ f(x)): the GEMV result is rounded to the dtype first, as the unfused
                     `F.linear` then `x + r` does. `out` may be `residual` (one program reads and writes a row).
"""
from __future__ import annotations

import functools
from typing import Mapping

import torch
import triton
import triton.language as tl

from . import tuning
from .common import (PROLOGUE_NONE, PROLOGUE_NORM, PROLOGUE_SWIGLU, epilogue, prologue_fx, rms_rstd, row_tile,
                     sm_count, split_k_epilogue, split_scratch)
from .tuning import GemvConfig


@triton.jit
def _dot_tile(w, X, NW, k0, cols, K, rstd, PROLOGUE: tl.constexpr, EVEN_K: tl.constexpr):
    """Σ_k w[:, k] · f(x)[k0 + k] -> [BN] fp32."""
    return tl.sum(w.to(tl.float32) * prologue_fx(X, NW, k0, cols, K, rstd, PROLOGUE, EVEN_K)[None, :], axis=1)


@triton.jit
def _gemv_split_kernel(W, X, NW, R, G, Y, P, CNT, N, K, stride_w, eps, PROLOGUE: tl.constexpr,
                       HAS_RESIDUAL: tl.constexpr, HAS_GATE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       EVEN_K: tl.constexpr, K_POW2: tl.constexpr, SPLIT_K: tl.constexpr):
    """Program (row block b, K slice s) multiplies ONE tile W[b·BN : (b+1)·BN, s·BK : (s+1)·BK] by f(x)'s slice:
    no loop, so every weight load of the program is issued at once (the persistent kernel keeps only two tiles
    in flight a program), and f(x) is computed once a program. With SPLIT_K > 1
    the fp32 partials go to P [SPLIT_K, N]; the program that draws the row block's last ticket sums them in
    slice order (bitwise the same whoever arrives last), applies the epilogue and re-arms the counter."""
    b = tl.program_id(0)
    s = tl.program_id(1)
    rows = b * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    k0 = s * BLOCK_K
    # rows past N re-read row N-1 (the stores are masked): weight loads stay unmasked 16-byte vectors
    w = row_tile(W, tl.minimum(rows, N - 1).to(tl.int64), stride_w, k0, cols, K, EVEN_K)
    rstd = 0.0
    if PROLOGUE == 1:
        rstd = rms_rstd(X, K, eps, K_POW2)
    part = _dot_tile(w, X, NW, k0, cols, K, rstd, PROLOGUE, EVEN_K)  # [BLOCK_N]
    split_k_epilogue(part, P, CNT, R, Y, rows, N, s, b, SPLIT_K, HAS_RESIDUAL, G, HAS_GATE)


@triton.jit
def _gemv_kernel(W, X, NW, R, G, Y, N, K, stride_w, eps, n_blocks, PROLOGUE: tl.constexpr,
                 HAS_RESIDUAL: tl.constexpr, HAS_GATE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 EVEN_K: tl.constexpr):
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
        j = i + 1  # the next tile, loaded now and used next iteration (by hand; _gemv_stream_kernel leaves it to
        # Triton's pipeliner, which does pipeline plain loads once the stride is known to be a multiple of 16)
        nrows = tl.minimum((pid + (j // n_k) * nprog) * BLOCK_N + r_off, N - 1).to(tl.int64)
        nk0 = (j % n_k) * BLOCK_K
        nptrs = W + nrows[:, None] * stride_w + nk0 + cols[None, :]
        # past this program's last tile the mask is all false (a limit of 0): no memory is touched
        if EVEN_K:
            w_next = tl.load(nptrs, mask=cols[None, :] < tl.where(j < total, BLOCK_K, 0), other=0.0)
        else:
            w_next = tl.load(nptrs, mask=nk0 + cols[None, :] < tl.where(j < total, K, 0), other=0.0)
        x = prologue_fx(X, NW, k0, cols, K, rstd, PROLOGUE, EVEN_K)
        acc += w.to(tl.float32) * x[None, :]
        if k0 + BLOCK_K >= K:  # the block's last chunk: its rows are done
            epilogue(tl.sum(acc, axis=1), R, Y, blk * BLOCK_N + r_off, N, HAS_RESIDUAL, G, HAS_GATE)
            acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)


@triton.jit
def _gemv_stream_kernel(W, X, NW, R, G, Y, N, K, stride_w, eps, n_blocks, PROLOGUE: tl.constexpr,
                        HAS_RESIDUAL: tl.constexpr, HAS_GATE: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, K_POW2: tl.constexpr, STAGES: tl.constexpr):
    """Persistent like _gemv_kernel (row blocks p, p + P, ...; tiles as one flat sequence), but the weight tiles
    go through shared memory by Triton's software pipeline (cp.async), STAGES tiles in flight a program, instead
    of through registers: bytes in flight are bounded by shared memory, not by the register file. K % BLOCK_K == 0."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n_k = K // BLOCK_K
    total = tl.cdiv(n_blocks - pid, nprog) * n_k  # tiles of this program
    r_off = tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    rstd = 0.0
    if PROLOGUE == 1:
        rstd = rms_rstd(X, K, eps, K_POW2)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for i in tl.range(0, total, num_stages=STAGES):
        blk = pid + (i // n_k) * nprog
        k0 = (i % n_k) * BLOCK_K
        rows_c = tl.minimum(blk * BLOCK_N + r_off, N - 1).to(tl.int64)  # past N: re-read row N-1, stores masked
        w = tl.load(W + rows_c[:, None] * stride_w + k0 + cols[None, :])
        acc += w.to(tl.float32) * prologue_fx(X, NW, k0, cols, K, rstd, PROLOGUE, True)[None, :]
        if k0 + BLOCK_K == K:  # the block's last chunk: its rows are done
            epilogue(tl.sum(acc, axis=1), R, Y, blk * BLOCK_N + r_off, N, HAS_RESIDUAL, G, HAS_GATE)
            acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)


def gemv_config(N: int, K: int, sms: int, elem: int = 2,
                table: Mapping[tuple[int, int], GemvConfig] = tuning.GEMV) -> GemvConfig:
    """The config for an [N, K] matrix of `elem`-byte elements on `sms` SMs: `table`'s row on a GPU, else the rule."""
    if sms and (N, K) in table:
        return table[(N, K)]
    return _rule_config(N, K, sms, elem)


@functools.lru_cache(maxsize=None)
def _rule_config(N: int, K: int, sms: int, elem: int) -> GemvConfig:
    """A persistent grid:

    * BLOCK_K = 16 bytes × 32 lanes × 4 warps (1024 bf16): every warp lies along K, so the 1-D f(x) chunk is
      already in the layout the [BLOCK_N, BLOCK_K] tile broadcasts it to (with 512 columns Triton moved it
      through shared memory with a barrier every chunk, seen in the TTGIR);
    * BLOCK_N = 8, up to 3 × sms programs, all resident at once, with the row blocks dealt out evenly.
    """
    if sms == 0:  # CPU, under TRITON_INTERPRET: its cost is per program and per op, not per byte, so one
        # program with big tiles (the engine's CPU tests ran ~7× slower with the GPU rule's many small tiles)
        return GemvConfig("persist", min(64, triton.next_power_of_2(N)), min(1024, triton.next_power_of_2(K)), 4, 1)
    block_k = min(16 // elem * 32 * 4, triton.next_power_of_2(K))
    block_n = 8
    n_blocks = triton.cdiv(N, block_n)
    per = triton.cdiv(n_blocks, 3 * sms)
    return GemvConfig("persist", block_n, block_k, 4, triton.cdiv(n_blocks, per))


def gemv_fwd(weight: torch.Tensor, x: torch.Tensor, *, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
             swiglu: bool = False, residual: torch.Tensor | None = None, gate: torch.Tensor | None = None,
             out: torch.Tensor | None = None, config: GemvConfig | tuple | None = None,
             table: Mapping[tuple[int, int], GemvConfig] = tuning.GEMV) -> torch.Tensor:
    """y = [residual +] weight @ f(x), weight [N, K] (rows contiguous), x [K] or [1, K] ([2K] or [1, 2K] with
    swiglu) -> [1, N] in x's dtype (or `out`). f: rms_norm with norm_weight [K], or swiglu, or identity.
    gate (one element): y = [residual +] gate · (weight @ f(x)), each product rounded.
    `config` (else `table`'s row for [N, K], else the rule) picks the kernel and its launch."""
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
    assert gate is None or gate.numel() == 1, "a gate is one element"
    cfg = GemvConfig(*config) if config is not None else gemv_config(N, K, sm_count(weight.device),
                                                                     weight.element_size(), table)
    prologue = PROLOGUE_SWIGLU if swiglu else PROLOGUE_NORM if norm_weight is not None else PROLOGUE_NONE
    nw = norm_weight if norm_weight is not None else xv
    r = residual if residual is not None else out
    g = gate if gate is not None else out
    flags = dict(HAS_RESIDUAL=residual is not None, HAS_GATE=gate is not None)
    bn, bk = cfg.block_n, cfg.block_k
    launch = dict(num_warps=cfg.warps)
    if cfg.kind == "split":
        blocks, split = triton.cdiv(N, bn), triton.cdiv(K, bk)
        p, c = split_scratch(weight.device, split * N, blocks)
        _gemv_split_kernel[(blocks, split)](
            weight, xv, nw, r, g, out, p, c, N, K, weight.stride(0), float(eps), PROLOGUE=prologue, **flags,
            BLOCK_N=bn, BLOCK_K=bk, EVEN_K=K % bk == 0,
            K_POW2=triton.next_power_of_2(K) if prologue == PROLOGUE_NORM else 1, SPLIT_K=split, **launch)
        return out
    n_blocks = triton.cdiv(N, bn)
    if cfg.kind == "stream":
        assert K % bk == 0, "stream: K must be a multiple of block_k"
        _gemv_stream_kernel[(min(cfg.programs or n_blocks, n_blocks),)](
            weight, xv, nw, r, g, out, N, K, weight.stride(0), float(eps), n_blocks, PROLOGUE=prologue, **flags,
            BLOCK_N=bn, BLOCK_K=bk, K_POW2=triton.next_power_of_2(K) if prologue == PROLOGUE_NORM else 1,
            STAGES=cfg.stages,
            num_stages=cfg.stages, **launch)
        return out
    assert cfg.kind == "persist", f"unknown GEMV kind {cfg.kind!r}"
    programs = n_blocks if cfg.programs is None else min(cfg.programs, n_blocks)
    _gemv_kernel[(programs,)](weight, xv, nw, r, g, out, N, K, weight.stride(0), float(eps), n_blocks,
                              PROLOGUE=prologue, **flags, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=K % bk == 0, **launch)
    return out

