"""Matrix-vector product in Triton for the batch-1 decode step: y[N] = W[N, K] @ f(x)[K], fp32 accumulation.

Why not cuBLAS: its M=1 kernel tiles 64 rows per CTA, so the 1B qkv/o shapes (N = 3072/2048) run on 48/32 CTAs
of 132 SMs at 2.2 TB/s, and down (K = 8192) needs a split-K reduce launch (nvidia-h200, 2026-11-21, NOTES.md).
Three kernels, chosen per shape by TABLE (GemvConfig.kind):
    split    grid (row blocks, K slices): each program multiplies ONE [BLOCK_N, BLOCK_K] tile, all its weight
             loads issued at once, f(x) computed once; partials of several slices are summed in slice order by
             the row block's last program to arrive (deterministic). Faster on 1B's four shapes and 3B's down
             (v3c: 2.8-3.5 TB/s where the persistent kernel reached 1.7-2.9);
    persist  row blocks of BLOCK_N whole rows dealt evenly to a persistent grid, two tiles in flight a program
             (the unfused 3B qkv);
    stream   persistent too, but the tiles pass through shared memory in Triton's cp.async software pipeline,
             STAGES deep, so the bytes in flight are not bounded by registers: 3-8% faster than split on 1B's
             down and 3B's o, gate_up and down (v7, NOTES.md).
Either may be launched with programmatic dependent launch (PDL_EARLY / PDL_LATE below; the decode step picks the
mode for all its kernels: accel.model.Kernels).
The decode step is launch-bound too, so the neighbouring elementwise ops fold into the GEMV:
    PROLOGUE_NORM    f(x) = rms_norm(x, norm_weight, eps), HF's cast order (accel/kernels/rms_norm.py): every
                     program computes the rms of the 4-6 KB vector from L2, cheaper than a launch (~2.3 µs);
    PROLOGUE_SWIGLU  x = [gate | up] (the fused gate_up output, 2K long), f(x) = silu(gate)·up rounded as
                     accel/kernels/swiglu.py rounds it;
    residual         y = residual + round(W @ f(x)): the GEMV result is rounded to the dtype first, as the unfused
                     `F.linear` then `x + r` does. `out` may be `residual` (one program reads and writes a row).
"""
from __future__ import annotations

import functools
import json
from typing import NamedTuple

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
def _rstd(X, K, eps, K_POW2: tl.constexpr):
    """1 / rms(x[0:K]) in fp32, the whole x in one round of loads (K <= K_POW2 <= 8192: <= 32 values a thread)."""
    kk = tl.arange(0, K_POW2)
    xs = tl.load(X + kk, mask=kk < K, other=0.0).to(tl.float32)
    return tl.rsqrt(tl.sum(xs * xs, axis=0) / K + eps)


PDL_OFF, PDL_EARLY, PDL_LATE = 0, 1, 2


@triton.jit
def pdl_wait(MODE: tl.constexpr):
    """Programmatic dependent launch (Hopper), for a kernel launched with launch_pdl: it may start while the
    previous kernel of the stream still runs, so everything before this wait may only read memory that no
    kernel of the step writes (the weights); the wait returns once the previous kernel has completed and its
    writes are visible. MODE PDL_EARLY also lets our own dependents launch now (they then stream their weights
    during our whole run); PDL_LATE lets them launch at `pdl_release`, once our weights have arrived."""
    if MODE == 1:
        tl.extra.cuda.gdc_launch_dependents()
    if MODE != 0:
        tl.extra.cuda.gdc_wait()


@triton.jit
def pdl_release(MODE: tl.constexpr):
    """PDL_LATE: our weight loads are consumed; the next kernel may launch and overlap our epilogue."""
    if MODE == 2:
        tl.extra.cuda.gdc_launch_dependents()


def pdl_launch(mode: int, device: torch.device) -> dict:
    """Launch options for a Triton kernel taking a PDL mode (no PDL off CUDA, e.g. under TRITON_INTERPRET)."""
    return {"launch_pdl": True} if mode and device.type == "cuda" else {}


@triton.jit
def _epilogue(acc, R, Y, rows, N, HAS_RESIDUAL: tl.constexpr):
    if HAS_RESIDUAL:  # round the product first, as the unfused F.linear then `x + r` does
        r = tl.load(R + tl.minimum(rows, N - 1))
        acc = acc.to(Y.dtype.element_ty).to(tl.float32) + r.to(tl.float32)
    tl.store(Y + rows, acc.to(Y.dtype.element_ty), mask=rows < N)


@triton.jit
def _tile(W, rows_c, stride_w, k0, cols, K, EVEN_K: tl.constexpr):
    """W[rows_c, k0 : k0 + BK] ([BN, BK], zeros past K)."""
    ptrs = W + rows_c[:, None] * stride_w + k0 + cols[None, :]
    if EVEN_K:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=k0 + cols[None, :] < K, other=0.0)


@triton.jit
def _dot_tile(w, X, NW, k0, cols, K, rstd, PROLOGUE: tl.constexpr, EVEN_K: tl.constexpr):
    """Σ_k w[:, k] · f(x)[k0 + k] -> [BN] fp32."""
    return tl.sum(w.to(tl.float32) * _fx(X, NW, k0, cols, K, rstd, PROLOGUE, EVEN_K)[None, :], axis=1)


@triton.jit
def _gemv_split_kernel(W, X, NW, R, Y, P, CNT, N, K, stride_w, eps, PROLOGUE: tl.constexpr,
                       HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       EVEN_K: tl.constexpr, K_POW2: tl.constexpr, SPLIT_K: tl.constexpr, PDL: tl.constexpr):
    """Program (row block b, K slice s) multiplies ONE tile W[b·BN : (b+1)·BN, s·BK : (s+1)·BK] by f(x)'s slice:
    no loop, so every weight load of the program is issued at once (the persistent kernel kept only two tiles,
    32 KB, in flight a program and reached 1.7-2.9 TB/s), and f(x) is computed once a program. With SPLIT_K > 1
    the fp32 partials go to P [SPLIT_K, N]; the program that draws the row block's last ticket sums them in
    slice order (bitwise the same whoever arrives last), applies the epilogue and re-arms the counter."""
    b = tl.program_id(0)
    s = tl.program_id(1)
    rows = b * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    k0 = s * BLOCK_K
    # rows past N re-read row N-1 (the stores are masked): weight loads stay unmasked 16-byte vectors
    w = _tile(W, tl.minimum(rows, N - 1).to(tl.int64), stride_w, k0, cols, K, EVEN_K)
    pdl_wait(PDL)
    rstd = 0.0
    if PROLOGUE == 1:
        rstd = _rstd(X, K, eps, K_POW2)
    part = _dot_tile(w, X, NW, k0, cols, K, rstd, PROLOGUE, EVEN_K)  # [BLOCK_N]
    pdl_release(PDL)
    if SPLIT_K == 1:
        _epilogue(part, R, Y, rows, N, HAS_RESIDUAL)
    else:
        tl.store(P + s * N + rows, part, mask=rows < N)
        # the CTA barrier orders every thread's partial stores before the one acq_rel add (a scalar atomic, one
        # thread): the last program to arrive has acquired all partials (the pattern of accel/kernels/decode_attn)
        tl.debug_barrier()
        ticket = tl.atomic_add(CNT + b, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT_K - 1:
            acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            for j in range(0, SPLIT_K):
                acc += tl.load(P + j * N + rows, mask=rows < N, other=0.0, cache_modifier=".cg")
            _epilogue(acc, R, Y, rows, N, HAS_RESIDUAL)
            tl.store(CNT + b, 0)  # every program of this row block has arrived: ready for the next launch


@triton.jit
def _gemv_kernel(W, X, NW, R, Y, N, K, stride_w, eps, n_blocks, PROLOGUE: tl.constexpr,
                 HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                 PDL: tl.constexpr):
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
    pdl_wait(PDL)  # the weights never depend on the previous kernel; x, the residual and `out` may
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
        if i == total - 1:  # the program's last tile has arrived
            pdl_release(PDL)


@triton.jit
def _gemv_stream_kernel(W, X, NW, R, Y, N, K, stride_w, eps, n_blocks, PROLOGUE: tl.constexpr,
                        HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        K_POW2: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr):
    """Persistent like _gemv_kernel (row blocks p, p + P, ...; tiles as one flat sequence), but the weight tiles
    go through shared memory by Triton's software pipeline (cp.async), STAGES tiles in flight a program, instead
    of through registers: bytes in flight are bounded by shared memory, not by the register file. K % BLOCK_K == 0.
    With PDL it waits before its first load (the pipeline issues weights and x together)."""
    pdl_wait(PDL)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n_k = K // BLOCK_K
    total = tl.cdiv(n_blocks - pid, nprog) * n_k  # tiles of this program
    r_off = tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    rstd = 0.0
    if PROLOGUE == 1:
        rstd = _rstd(X, K, eps, K_POW2)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for i in tl.range(0, total, num_stages=STAGES):
        blk = pid + (i // n_k) * nprog
        k0 = (i % n_k) * BLOCK_K
        rows_c = tl.minimum(blk * BLOCK_N + r_off, N - 1).to(tl.int64)  # past N: re-read row N-1, stores masked
        w = tl.load(W + rows_c[:, None] * stride_w + k0 + cols[None, :])
        acc += w.to(tl.float32) * _fx(X, NW, k0, cols, K, rstd, PROLOGUE, True)[None, :]
        if k0 + BLOCK_K == K:  # the block's last chunk: its rows are done
            _epilogue(tl.sum(acc, axis=1), R, Y, blk * BLOCK_N + r_off, N, HAS_RESIDUAL)
            acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    pdl_release(PDL)


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0


class GemvConfig(NamedTuple):
    """kind "persist" / "stream": _gemv_kernel / _gemv_stream_kernel on `programs` programs (None: one a row
    block); kind "split": _gemv_split_kernel on a (row blocks, K / block_k) grid (`programs` unused). pdl: PDL_OFF,
    PDL_EARLY or PDL_LATE (True reads as PDL_EARLY, the one mode of the v3c sweep JSONs)."""
    kind: str
    block_n: int
    block_k: int
    warps: int
    programs: int | None = None
    pdl: int = PDL_OFF
    stages: int = 3  # kind "stream": tiles in flight a program


# The config per (N, K) on the GPU: the fastest of `tools.bench.gemv_sweep` without PDL (nvidia-h200, 2026-11-21
# 11:17 UTC, tools/bench/results/h200-2026-11-21-v3c-gemv-sweep.json), µs a call in a graph vs the unfused
# cuBLAS sequence it replaces (vs v3b's table): 1B qkv 6.15 vs 8.16 (6.78), o 4.43 vs 7.49 (5.12); 3B qkv 11.91
# vs 12.36. 1B gate_up: 4 × 2048 tiles, 19.27 / 19.12 µs in two sweeps (v6c, v6e) against 19.56 / 19.42 with
# 8 × 2048 (v3c: 19.82; rms_norm + cuBLAS 21.71). The lm_head with the final norm folded in (v6b): 1B 119.8 vs
# 129.4, 3B 177.7 vs 190.4 (rms_norm + cuBLAS); the streaming kernel ties there (v7d: 119.2 vs 117.9, 175.2 vs
# 175.2). Streaming kernel (v7c / v7d, two sweeps, -v7c-stream.json, -v7d-stream.json), against the split one:
# 1B down 11.62 / 11.50 vs 12.05 / 12.09; 3B o 7.37 / 7.29 vs 7.48 / 7.43, gate_up 27.49 (16 × 512, 4 stages) /
# 26.91 (3 stages) vs 28.25 / 28.27, down 15.61 / 15.39 vs 16.81 / 16.72; engine decode 3B 494.9 -> 515.2 tok/s,
# 1B 1233.1 -> 1249.2 (v7d). For 1B down and 3B o / down the sweep's 396-660 programs exceed the 256 / 384 row
# blocks (the launch caps them): one row block a program, streamed along K; 3B gate_up: 2 programs an SM over
# 1024 blocks. 1B o and gate_up keep the split kernel (4.76 vs 4.76, 19.23 vs 19.44). Swept on 132 SMs.
# qkv is fused with RoPE in the decode step (accel/kernels/qkv_rope.py); its entries serve the unfused path.
# PDL was slower in the engine every time (v3c, v6a): NOTES.md. Shapes not listed use gemv_config's rule.
TABLE: dict[tuple[int, int], GemvConfig] = {
    (3072, 2048): GemvConfig("split", 8, 2048, 8), (2048, 2048): GemvConfig("split", 8, 2048, 8),
    (16384, 2048): GemvConfig("split", 4, 2048, 4), (2048, 8192): GemvConfig("stream", 8, 512, 4, 256, PDL_OFF, 4),
    (5120, 3072): GemvConfig("persist", 4, 1024, 4, 640),
    (3072, 3072): GemvConfig("stream", 8, 512, 4, 384, PDL_OFF, 4),
    (16384, 3072): GemvConfig("stream", 16, 512, 4, 264, PDL_OFF, 3),
    (3072, 8192): GemvConfig("stream", 8, 512, 4, 384, PDL_OFF, 4),
    (128256, 2048): GemvConfig("split", 8, 2048, 8), (128256, 3072): GemvConfig("split", 4, 4096, 8),
}


def load_choices(path: str) -> set[tuple[int, int]]:
    """Install a sweep JSON's winners into TABLE (tools.bench.gemv_sweep.decode_compare); returns the shapes where
    cuBLAS won (for accel.model.CUBLAS_SHAPES)."""
    with open(path) as f:
        data = json.load(f)
    cublas = set()
    for r in data["rows"]:
        if r["best_config"] is None and not r["use_cublas"]:
            continue
        if r["use_cublas"]:
            cublas.add((r["N"], r["K"]))
        else:
            TABLE[(r["N"], r["K"])] = GemvConfig(*r["best_config"])
    gemv_config.cache_clear()
    return cublas


@functools.lru_cache(maxsize=None)
def gemv_config(N: int, K: int, sms: int, elem: int = 2) -> GemvConfig:
    """The config for an [N, K] matrix of `elem`-byte elements on `sms` SMs: TABLE, else a persistent grid:

    * BLOCK_K = 16 bytes × 32 lanes × 4 warps (1024 bf16): every warp lies along K, so the 1-D f(x) chunk is
      already in the layout the [BLOCK_N, BLOCK_K] tile broadcasts it to (with 512 columns Triton moved it
      through shared memory with a barrier every chunk: seen in the TTGIR, v3a);
    * BLOCK_N = 8, up to 3 × sms programs, all resident at once, with the row blocks dealt out evenly.
    """
    if (N, K) in TABLE and sms:
        return TABLE[(N, K)]
    if sms == 0:  # CPU, under TRITON_INTERPRET: its cost is per program and per op, not per byte, so one
        # program with big tiles (the engine's CPU tests ran ~7× slower with the GPU rule's many small tiles)
        return GemvConfig("persist", min(64, triton.next_power_of_2(N)), min(1024, triton.next_power_of_2(K)), 4, 1)
    block_k = min(16 // elem * 32 * 4, triton.next_power_of_2(K))
    block_n = 8
    n_blocks = triton.cdiv(N, block_n)
    per = triton.cdiv(n_blocks, 3 * sms)
    return GemvConfig("persist", block_n, block_k, 4, triton.cdiv(n_blocks, per))


_SCRATCH: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
_RETIRED: list[torch.Tensor] = []  # outgrown scratch stays allocated: a captured graph may still point at it


def _scratch(device: torch.device, partials: int, counters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The split kernel's fp32 partials and per-row-block arrival counters (zeros between launches), one pair a
    device, grown on demand. One stream at a time (the decode step): two split GEMVs running concurrently on
    different streams would share them. Grown before a graph capture by the engine's warm-up steps."""
    p, c = _SCRATCH.get(device, (None, None))
    if p is None or p.numel() < partials or c.numel() < counters:
        if p is not None:
            _RETIRED.extend((p, c))
        # sized for every Llama 3.2 shape at once (16 slices × 16384 rows; 16384 / 4 row blocks): 1 MB
        p = torch.empty(max(partials, 1 << 18), dtype=torch.float32, device=device)
        c = torch.zeros(max(counters, 1 << 13), dtype=torch.int32, device=device)
        _SCRATCH[device] = (p, c)
    return p, c


def gemv_fwd(weight: torch.Tensor, x: torch.Tensor, *, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
             swiglu: bool = False, residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
             config: GemvConfig | tuple | None = None, pdl: int | None = None) -> torch.Tensor:
    """y = [residual +] weight @ f(x), weight [N, K] (rows contiguous), x [K] or [1, K] ([2K] or [1, 2K] with
    swiglu) -> [1, N] in x's dtype (or `out`). f: rms_norm with norm_weight [K], or swiglu, or identity.
    pdl (not None) overrides the config's PDL mode."""
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
    cfg = GemvConfig(*config) if config is not None else gemv_config(N, K, _sm_count(weight.device),
                                                                     weight.element_size())
    prologue = PROLOGUE_SWIGLU if swiglu else PROLOGUE_NORM if norm_weight is not None else PROLOGUE_NONE
    nw = norm_weight if norm_weight is not None else xv
    r = residual if residual is not None else out
    bn, bk = cfg.block_n, cfg.block_k
    pdl = int(cfg.pdl if pdl is None else pdl) if weight.device.type == "cuda" else PDL_OFF
    launch = dict(num_warps=cfg.warps, **pdl_launch(pdl, weight.device))
    if cfg.kind == "split":
        blocks, split = triton.cdiv(N, bn), triton.cdiv(K, bk)
        p, c = _scratch(weight.device, split * N, blocks)
        _gemv_split_kernel[(blocks, split)](
            weight, xv, nw, r, out, p, c, N, K, weight.stride(0), float(eps), PROLOGUE=prologue,
            HAS_RESIDUAL=residual is not None, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=K % bk == 0,
            K_POW2=triton.next_power_of_2(K) if prologue == PROLOGUE_NORM else 1, SPLIT_K=split, PDL=pdl, **launch)
        return out
    n_blocks = triton.cdiv(N, bn)
    if cfg.kind == "stream":
        assert K % bk == 0, "stream: K must be a multiple of block_k"
        _gemv_stream_kernel[(min(cfg.programs or n_blocks, n_blocks),)](
            weight, xv, nw, r, out, N, K, weight.stride(0), float(eps), n_blocks, PROLOGUE=prologue,
            HAS_RESIDUAL=residual is not None, BLOCK_N=bn, BLOCK_K=bk,
            K_POW2=triton.next_power_of_2(K) if prologue == PROLOGUE_NORM else 1, STAGES=cfg.stages, PDL=pdl,
            num_stages=cfg.stages, **launch)
        return out
    assert cfg.kind == "persist", f"unknown GEMV kind {cfg.kind!r}"
    programs = n_blocks if cfg.programs is None else min(cfg.programs, n_blocks)
    _gemv_kernel[(programs,)](weight, xv, nw, r, out, N, K, weight.stride(0), float(eps), n_blocks,
                              PROLOGUE=prologue, HAS_RESIDUAL=residual is not None, BLOCK_N=bn, BLOCK_K=bk,
                              EVEN_K=K % bk == 0, PDL=pdl, **launch)
    return out

