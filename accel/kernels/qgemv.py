"""Weight-only quantized matrix-vector product in Triton: the decode step (the prefill: kernels/qdequant.py).

A quantized matrix W [N, K] arrives as (accel.quant_ops.QuantTensor):
    Q  int8 [N, K] (BITS 8) or uint8 [N, K/2] (BITS 4: byte j = code 2j | code 2j+1 << 4)
    S  [N, ceil(K/GROUP)] scales, M the same shape of minima (HAS_MIN) or none; any float dtype, read as fp32
    W[n, k] = (Q[n, k] − OFFSET) · S[n, k // GROUP] (+ M[n, k // GROUP])   (OFFSET 8 for GGUF's Q4_0, else 0)
That covers int8 per row (GROUP = K), int4 in groups (GROUP 32/64/128) and GGUF's Q8_0 / Q4_0 / Q4_1 (GROUP 32,
their blocks rearranged at load). The GEMV never forms W: per 16-byte chunk of a row (inside one group) a thread
sums Q·f(x) and Σ f(x), then y += S·(Σ Q·f(x) − OFFSET·Σ f(x)) + M·Σ f(x) — the same value as multiplying
by the dequantized W, up to fp32 summation order. Σ Q·f(x) is an integer sum (kernels/qdot.py): f(x) becomes a
chunk's 22-bit fixed point F = f(x)·2^s in three bytes, and dp4a multiplies 4 codes by 4 bytes an instruction,
exactly; only float(Σ Q·F)·2^-s rounds. The prologues (RMSNorm, SwiGLU) and the residual epilogue are
accel/kernels/common.py's (as gemv.py's), so the decode step's fusions carry over unchanged; a program multiplies
a row block over one K slice and, with SPLIT_K > 1, the row block's last program to arrive sums the slices in order
(gemv.py's split kernel does the same). The qkv GEMV also has qkv_rope.py's RoPE + KV-cache-write epilogue
(`qkv_rope_qfwd`). Launch configs: accel/kernels/tuning.py's QGEMV, else `qgemv_config`'s rule.

PDL (programmatic dependent launch, sm_90+; `PdlMode`, the default by code width: `PDL_DEFAULT`): each of
these kernels may then be launched while the kernel before it is still running. Before `gdc_wait` a program only
prefetches its own weight tiles and scales into L2 (weights are not written after load; a prefetch is a hint,
and L2 is where writes land, so a line fetched early is still current); x, the norm weight, the residual, `out`,
the cache and the split-K scratch are touched only after the wait, which returns once the previous kernel has
finished and its writes are visible. Every write comes after the wait, so a kernel never overwrites what an
earlier one still reads (the split-K partials and counters, which consecutive GEMVs share, included). The trigger
that lets the NEXT kernel launch comes after our own wait (or after the main loop), never before it: of these
kernels, the running one and the next one's prologue overlap, no more (the decode attention triggers at its start,
so behind it a third may wait; a wait covers all that ran before, so that stays correct). Launched plainly, the
qkv + RoPE kernel still triggers, at its start (it has no wait): the decode attention after it is PDL-launched over
long caches.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Mapping, NamedTuple

import torch
import triton
import triton.language as tl

from . import tuning
from .common import (PROLOGUE_NONE, PROLOGUE_NORM, PROLOGUE_SWIGLU, epilogue, gdc_launch_dependents, gdc_wait,
                     pdl_available, prefetch_l2, prefetch_rows_l2, prologue_fx, rms_rstd, sm_count, split_k_epilogue,
                     split_scratch)
from .qdot import chunk_dots, fixed_point, group_param
from .qkv_rope import rope_store
from .tuning import QGemvConfig


@triton.jit
def _fx_fixed(X, NW, k0, jc, K, rstd, PROLOGUE: tl.constexpr, NC: tl.constexpr, CHUNK: tl.constexpr,
              NEED_XC: tl.constexpr):
    """f(x) of the columns k0 + jc as each chunk's fixed point -> F [NC, CHUNK], 2^-s [NC] and (NEED_XC) Σ f(x)
    a chunk [NC] (else 2^-s again, unused)."""
    fx = prologue_fx(X, NW, k0, jc, K, rstd, PROLOGUE, False)  # [BK] fp32, zeros past K
    F, unit = fixed_point(fx, NC, CHUNK)  # [NC, CHUNK], [NC]
    xc = unit
    if NEED_XC:
        xc = tl.sum(tl.reshape(fx, [NC, CHUNK]), axis=1)  # [NC] Σ f(x) a chunk
    return F, unit, xc


@triton.jit
def _tile_sums(Q, S, M, rows_c, kb0, jw, KB, stride_q, stride_s, n_groups, F, unit, xc, BITS: tl.constexpr,
               OFFSET: tl.constexpr, GROUP: tl.constexpr, HAS_MIN: tl.constexpr, PER_ROW: tl.constexpr,
               BLOCK_N: tl.constexpr, NC: tl.constexpr, CHUNK: tl.constexpr, FAST: tl.constexpr):
    """The [BN, NC] chunk sums of the tile at byte column kb0 for f(x)'s fixed point F (`_fx_fixed`), times the
    group's scale (+ minimum · Σ f(x)); unscaled with PER_ROW."""
    k0 = kb0 * (8 // BITS)
    part = chunk_dots(Q, rows_c, kb0, jw, KB, stride_q, F, BITS, BLOCK_N, NC, CHUNK, FAST) * unit[None, :]
    if OFFSET != 0:
        part -= OFFSET * xc[None, :]
    if not PER_ROW:
        g = (k0 + tl.arange(0, NC) * CHUNK) // GROUP  # [NC] the group of each chunk
        inside = (g[None, :] < n_groups) & (rows_c[:, None] >= 0)  # [BN, NC] (rows_c >= 0 always: the shape)
        part *= group_param(S + rows_c[:, None] * stride_s + g[None, :], inside, FAST)
        if HAS_MIN:
            part += group_param(M + rows_c[:, None] * stride_s + g[None, :], inside, FAST) * xc[None, :]
    return part


@triton.jit
def _qtile(Q, S, M, X, NW, rows_c, kb0, jw, jc, K, KB, stride_q, stride_s, rstd, n_groups, BITS: tl.constexpr,
           OFFSET: tl.constexpr, GROUP: tl.constexpr, HAS_MIN: tl.constexpr, PER_ROW: tl.constexpr,
           PROLOGUE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK: tl.constexpr,
           FAST: tl.constexpr):
    """One [BLOCK_N, BLOCK_K] tile at byte column kb0 -> [BN, BLOCK_K / CHUNK] fp32: per CHUNK columns (the 16
    bytes a thread loads: inside one group) Σ q·f(x), times the group's scale (+ minimum · Σ f(x)); unscaled
    with PER_ROW. f(x) is computed once per column for all BN rows and goes into the integer products as a
    chunk's fixed point (`fixed_point`), so the codes need no conversion to float: 4 products an instruction."""
    NC: tl.constexpr = BLOCK_K // CHUNK
    F, unit, xc = _fx_fixed(X, NW, kb0 * (8 // BITS), jc, K, rstd, PROLOGUE, NC, CHUNK, OFFSET != 0 or HAS_MIN)
    return _tile_sums(Q, S, M, rows_c, kb0, jw, KB, stride_q, stride_s, n_groups, F, unit, xc, BITS, OFFSET, GROUP,
                      HAS_MIN, PER_ROW, BLOCK_N, NC, CHUNK, FAST)


@triton.jit
def _qdot(Q, S, M, X, NW, rows_c, kb_lo, kb_hi, K, KB, stride_q, stride_s, eps, n_groups, BITS: tl.constexpr,
          OFFSET: tl.constexpr, GROUP: tl.constexpr, HAS_MIN: tl.constexpr, PER_ROW: tl.constexpr,
          PROLOGUE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_POW2: tl.constexpr,
          STAGES: tl.constexpr, FAST: tl.constexpr):
    """Σ_k W[rows_c, k] · f(x)[k] over bytes kb_lo .. kb_hi of the rows -> [BLOCK_N] fp32, scaled."""
    BYTES: tl.constexpr = BLOCK_K * BITS // 8
    CHUNK: tl.constexpr = 128 // BITS  # 16 bytes
    jw = tl.arange(0, BYTES // 4)
    jc = tl.arange(0, BLOCK_K)
    rstd = 0.0
    if PROLOGUE == 1:
        rstd = rms_rstd(X, K, eps, K_POW2)
    acc = tl.zeros([BLOCK_N, BLOCK_K // CHUNK], dtype=tl.float32)
    for kb0 in tl.range(kb_lo, kb_hi, BYTES, num_stages=STAGES):
        acc += _qtile(Q, S, M, X, NW, rows_c, kb0, jw, jc, K, KB, stride_q, stride_s, rstd, n_groups, BITS, OFFSET,
                      GROUP, HAS_MIN, PER_ROW, PROLOGUE, BLOCK_N, BLOCK_K, CHUNK, FAST)
    out = tl.sum(acc, axis=1)
    if PER_ROW:
        out *= tl.load(S + rows_c * stride_s).to(tl.float32)
    return out


@triton.jit
def _pdl_start(Q, S, M, rows_c, kb_lo, kb_hi, stride_q, stride_s, BITS: tl.constexpr, GROUP: tl.constexpr,
               HAS_MIN: tl.constexpr, PDL: tl.constexpr, TRIGGER: tl.constexpr, PF_LINES: tl.constexpr):
    """A program's start (module doc, PDL): the first PF_LINES 128-byte lines of each of its rows' bytes
    kb_lo..kb_hi and the rows' first scale (and minimum) line into L2, then (PDL) the wait for the previous kernel.
    TRIGGER 1: then let the next kernel launch (2: the caller does, after its main loop)."""
    if PF_LINES > 0:
        prefetch_rows_l2(Q, rows_c, stride_q, kb_lo, kb_hi, 128, PF_LINES)
        g0 = kb_lo * (8 // BITS) // GROUP
        prefetch_l2(S + rows_c * stride_s + g0)
        if HAS_MIN:
            prefetch_l2(M + rows_c * stride_s + g0)
    if PDL:
        gdc_wait()
    if TRIGGER == 1:
        gdc_launch_dependents()


@triton.jit
def _rows_dot(Q, S, M, X, NW, rows_c, kb_lo, kb_hi, K, KB, stride_q, stride_s, eps, n_groups, BITS: tl.constexpr,
              OFFSET: tl.constexpr, GROUP: tl.constexpr, HAS_MIN: tl.constexpr, PER_ROW: tl.constexpr,
              PROLOGUE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_POW2: tl.constexpr,
              STAGES: tl.constexpr, FAST: tl.constexpr, PDL: tl.constexpr, TRIGGER: tl.constexpr,
              PF_LINES: tl.constexpr):
    """A kernel's body up to its epilogue: `_pdl_start`, `_qdot` over bytes kb_lo .. kb_hi of rows_c, and with
    TRIGGER 2 the next kernel's launch after the main loop -> [BLOCK_N] fp32."""
    _pdl_start(Q, S, M, rows_c, kb_lo, kb_hi, stride_q, stride_s, BITS, GROUP, HAS_MIN, PDL, TRIGGER, PF_LINES)
    acc = _qdot(Q, S, M, X, NW, rows_c, kb_lo, kb_hi, K, KB, stride_q, stride_s, eps, n_groups, BITS, OFFSET, GROUP,
                HAS_MIN, PER_ROW, PROLOGUE, BLOCK_N, BLOCK_K, K_POW2, STAGES, FAST)
    if TRIGGER == 2:
        gdc_launch_dependents()
    return acc


@triton.jit
def _whole_rows(X, NW, K, eps, BITS: tl.constexpr, OFFSET: tl.constexpr, HAS_MIN: tl.constexpr,
                PROLOGUE: tl.constexpr, BLOCK_K: tl.constexpr, K_POW2: tl.constexpr):
    """The persistent kernels' f(x) over the whole row (one tile), as its fixed point, once a program: F, 2^-s,
    Σ f(x) a chunk (`_fx_fixed`)."""
    CHUNK: tl.constexpr = 128 // BITS
    rstd = 0.0
    if PROLOGUE == 1:
        rstd = rms_rstd(X, K, eps, K_POW2)
    return _fx_fixed(X, NW, 0, tl.arange(0, BLOCK_K), K, rstd, PROLOGUE, BLOCK_K // CHUNK, CHUNK,
                     OFFSET != 0 or HAS_MIN)


@triton.jit
def _block_sums(Q, S, M, rows_c, next_c, KB, stride_q, stride_s, n_groups, F, unit, xc, BITS: tl.constexpr,
                OFFSET: tl.constexpr, GROUP: tl.constexpr, HAS_MIN: tl.constexpr, PER_ROW: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FAST: tl.constexpr, SLINES: tl.constexpr):
    """A persistent program's row block rows_c over the whole row (one tile, f(x) given) -> [BLOCK_N] fp32,
    scaled. SLINES > 0: first the scale (and minimum) lines of the program's next row block next_c into L2 (a hint:
    those small loads are not in the cp.async pipeline the codes are)."""
    CHUNK: tl.constexpr = 128 // BITS
    if SLINES > 0:
        LINE: tl.constexpr = 1024 // S.dtype.element_ty.primitive_bitwidth  # elements a 128-byte line
        prefetch_rows_l2(S, next_c, stride_s, 0, n_groups, LINE, SLINES)
        if HAS_MIN:
            prefetch_rows_l2(M, next_c, stride_s, 0, n_groups, LINE, SLINES)
    part = _tile_sums(Q, S, M, rows_c, 0, tl.arange(0, BLOCK_K * BITS // 32), KB, stride_q, stride_s, n_groups, F,
                      unit, xc, BITS, OFFSET, GROUP, HAS_MIN, PER_ROW, BLOCK_N, BLOCK_K // CHUNK, CHUNK, FAST)
    out = tl.sum(part, axis=1)
    if PER_ROW:
        out *= tl.load(S + rows_c * stride_s).to(tl.float32)
    return out


@triton.jit
def _halves(acc, HN: tl.constexpr):
    """[2·HN] sums of a paired-rows program (its first HN rows, then the HN rows they pair with) -> the two [HN]."""
    return tl.split(tl.permute(tl.reshape(acc, [2, HN]), [1, 0]))


@triton.jit
def _qgemv_kernel(Q, S, M, X, NW, R, Y, P, CNT, N, K, KB, stride_q, stride_s, eps, n_groups, kb_split,
                  BITS: tl.constexpr, OFFSET: tl.constexpr, GROUP: tl.constexpr, HAS_MIN: tl.constexpr,
                  PER_ROW: tl.constexpr, PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, K_POW2: tl.constexpr, SPLIT_K: tl.constexpr, STAGES: tl.constexpr,
                  FAST: tl.constexpr,
                  PDL: tl.constexpr = False, TRIGGER: tl.constexpr = 0, PF_LINES: tl.constexpr = 0,
                  PERSIST: tl.constexpr = False, SLINES: tl.constexpr = 0):
    """Program (row block b, K slice s): rows b·BN .. (b+1)·BN over bytes s·kb_split .. (s+1)·kb_split of Q.
    PERSIST (one K slice, one tile a row): program b takes row blocks b, b + programs, ... through a STAGES-deep
    cp.async pipeline, f(x)'s fixed point built once; SLINES: `_block_sums`. PDL, TRIGGER, PF_LINES: `_pdl_start`."""
    b = tl.program_id(0)
    if PERSIST:
        step = tl.num_programs(0)
        _pdl_start(Q, S, M, tl.minimum(b * BLOCK_N + tl.arange(0, BLOCK_N), N - 1).to(tl.int64), 0, KB, stride_q,
                   stride_s, BITS, GROUP, HAS_MIN, PDL, TRIGGER, PF_LINES)
        F, unit, xc = _whole_rows(X, NW, K, eps, BITS, OFFSET, HAS_MIN, PROLOGUE, BLOCK_K, K_POW2)
        for blk in tl.range(b, tl.cdiv(N, BLOCK_N), step, num_stages=STAGES):
            rows = blk * BLOCK_N + tl.arange(0, BLOCK_N)
            rows_c = tl.minimum(rows, N - 1).to(tl.int64)
            acc = _block_sums(Q, S, M, rows_c, tl.minimum(rows + step * BLOCK_N, N - 1).to(tl.int64), KB, stride_q,
                              stride_s, n_groups, F, unit, xc, BITS, OFFSET, GROUP, HAS_MIN, PER_ROW, BLOCK_N,
                              BLOCK_K, FAST, SLINES)
            epilogue(acc, R, Y, rows, N, HAS_RESIDUAL)
        if TRIGGER == 2:
            gdc_launch_dependents()
    else:
        sp = tl.program_id(1)
        rows = b * BLOCK_N + tl.arange(0, BLOCK_N)
        rows_c = tl.minimum(rows, N - 1).to(tl.int64)  # rows past N re-read row N-1; the stores are masked
        kb_lo = sp * kb_split
        acc = _rows_dot(Q, S, M, X, NW, rows_c, kb_lo, tl.minimum(kb_lo + kb_split, KB), K, KB, stride_q, stride_s,
                        eps, n_groups, BITS, OFFSET, GROUP, HAS_MIN, PER_ROW, PROLOGUE, BLOCK_N, BLOCK_K, K_POW2,
                        STAGES, FAST, PDL, TRIGGER, PF_LINES)
        split_k_epilogue(acc, P, CNT, R, Y, rows, N, sp, b, SPLIT_K, HAS_RESIDUAL)


@triton.jit
def _qkv_rope_kernel(Q, S, M, X, NW, COS, SIN, POS, QO, CK, CV, K, KB, stride_q, stride_s, eps, n_groups, s_cos,
                     s_sin, sc_k, sc_s, scv_k, scv_s, H, NKV, E: tl.constexpr, BITS: tl.constexpr,
                     OFFSET: tl.constexpr, GROUP: tl.constexpr, HAS_MIN: tl.constexpr, PER_ROW: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_POW2: tl.constexpr, STAGES: tl.constexpr,
                     FAST: tl.constexpr,
                     PDL: tl.constexpr = False, TRIGGER: tl.constexpr = 0, PF_LINES: tl.constexpr = 0):
    """accel/kernels/qkv_rope.py's norm + qkv + RoPE + cache write for a quantized weight: a program's BLOCK_N
    rows are BLOCK_N/2 columns of the first half of one head and the matching BLOCK_N/2 of its second half.
    PDL, TRIGGER, PF_LINES: `_pdl_start` (TRIGGER 1 without PDL: at once, for the decode attention after us)."""
    half: tl.constexpr = E // 2
    HN: tl.constexpr = BLOCK_N // 2
    per_head: tl.constexpr = (half + HN - 1) // HN
    b = tl.program_id(0)
    head = b // per_head  # over the H + 2·NKV heads of the fused output: q heads, then k, then v
    i = tl.arange(0, BLOCK_N)
    c = (b % per_head) * HN + i % HN  # [BN] the column in the head's first half
    rows_c = (head * E + tl.minimum(c, half - 1) + (i // HN) * half).to(tl.int64)  # tail columns re-read a row
    acc = _rows_dot(Q, S, M, X, NW, rows_c, 0, KB, K, KB, stride_q, stride_s, eps, n_groups, BITS, OFFSET, GROUP,
                    HAS_MIN, PER_ROW, 1, BLOCK_N, BLOCK_K, K_POW2, STAGES, FAST, PDL, TRIGGER, PF_LINES)
    a1, a2 = _halves(acc, HN)  # [HN] each: first-half and second-half rows
    cols = (b % per_head) * HN + tl.arange(0, HN)
    pos = tl.load(POS).to(tl.int64)
    rope_store(a1, a2, head, cols, cols < half, pos, COS, SIN, QO, CK, CV, s_cos, s_sin, sc_k, sc_s, scv_k, scv_s, H,
               NKV, E)


@triton.jit
def _gate_up_swiglu_kernel(Q, S, M, X, NW, Y, F, K, KB, stride_q, stride_s, eps, n_groups, BITS: tl.constexpr,
                           OFFSET: tl.constexpr, GROUP: tl.constexpr, HAS_MIN: tl.constexpr, PER_ROW: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_POW2: tl.constexpr,
                           STAGES: tl.constexpr, FAST: tl.constexpr,
                           PDL: tl.constexpr = False, TRIGGER: tl.constexpr = 0, PF_LINES: tl.constexpr = 0,
                           PERSIST: tl.constexpr = False, SLINES: tl.constexpr = 0):
    """norm + gate_up GEMV + SwiGLU: a program's BLOCK_N rows are BLOCK_N/2 gate rows and the matching up rows
    (F further down: the qkv + RoPE kernel's pairing), so its epilogue writes silu(gate)·up straight to Y [F].
    PERSIST, SLINES: as `_qgemv_kernel`'s. PDL, TRIGGER, PF_LINES: `_pdl_start`."""
    HN: tl.constexpr = BLOCK_N // 2
    b = tl.program_id(0)
    i = tl.arange(0, BLOCK_N)
    if PERSIST:
        step = tl.num_programs(0)
        _pdl_start(Q, S, M, _pair_rows(b, i, F, HN), 0, KB, stride_q, stride_s, BITS, GROUP, HAS_MIN, PDL, TRIGGER,
                   PF_LINES)
        fx, unit, xc = _whole_rows(X, NW, K, eps, BITS, OFFSET, HAS_MIN, 1, BLOCK_K, K_POW2)
        for blk in tl.range(b, tl.cdiv(F, HN), step, num_stages=STAGES):
            acc = _block_sums(Q, S, M, _pair_rows(blk, i, F, HN), _pair_rows(blk + step, i, F, HN), KB, stride_q,
                              stride_s, n_groups, fx, unit, xc, BITS, OFFSET, GROUP, HAS_MIN, PER_ROW, BLOCK_N,
                              BLOCK_K, FAST, SLINES)
            _swiglu_store(acc, Y, blk, F, HN)
        if TRIGGER == 2:
            gdc_launch_dependents()
    else:
        acc = _rows_dot(Q, S, M, X, NW, _pair_rows(b, i, F, HN), 0, KB, K, KB, stride_q, stride_s, eps, n_groups,
                        BITS, OFFSET, GROUP, HAS_MIN, PER_ROW, 1, BLOCK_N, BLOCK_K, K_POW2, STAGES, FAST, PDL,
                        TRIGGER, PF_LINES)
        _swiglu_store(acc, Y, b, F, HN)


@triton.jit
def _pair_rows(b, i, F, HN: tl.constexpr):
    """Row block b of the gate_up pairing: gate rows b·HN + i (i < HN), then the up rows F further down."""
    return (tl.minimum(b * HN + i % HN, F - 1) + (i // HN) * F).to(tl.int64)  # tail columns re-read a row


@triton.jit
def _swiglu_store(acc, Y, b, F, HN: tl.constexpr):
    """Y[b·HN ..] = silu(gate)·up of a paired block's sums acc [2·HN]."""
    g, u = _halves(acc, HN)  # [HN] each: the gate and the up rows
    dt = Y.dtype.element_ty  # the roundings of the unfused path: gate_up's output, silu's, the product's
    g = g.to(dt).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dt)
    cols = b * HN + tl.arange(0, HN)
    tl.store(Y + cols, (act.to(tl.float32) * u.to(dt).to(tl.float32)).to(dt), mask=cols < F)


def qgemv_config(N: int, K: int, bits: int, group: int, sms: int, whole_rows: bool = False,
                 table: Mapping[tuple, QGemvConfig] = tuning.QGEMV) -> QGemvConfig:
    """`table`'s row for (N, K, bits, group) on a GPU, else the rule: ONE tile a program (all its loads issued at
    once, like gemv.py's "split" kind) of 2048, 1024 or 512 bytes of a row (16 B a lane, warps along K, so each
    thread's f(x) serves all its rows; the widest that divides the row), 16 rows (8 at 4 bits: twice the codes
    a byte), split-K over the tiles. whole_rows: a program owns whole rows, no split-K (the qkv + RoPE kernel, its
    table rows tagged "rope", and the gate_up + SwiGLU kernel): its tiles go through a 3-stage cp.async pipeline
    instead. On CPU (the interpreter, whose cost is per program and per op): one big tile."""
    key = (N, K, bits, group) + (("rope",) if whole_rows else ())
    if sms and key in table:
        return table[key]
    chunk = 128 // bits
    if sms == 0:
        return QGemvConfig(min(32, triton.next_power_of_2(N)), max(chunk, min(1024, triton.next_power_of_2(K))),
                           4, 1, 1)
    kbytes = triton.cdiv(K * bits, 8)
    nbytes = next((b for b in (2048, 1024, 512) if kbytes % b == 0), min(2048, triton.next_power_of_2(kbytes)))
    bk = nbytes * 8 // bits
    tiles = triton.cdiv(K, bk)
    bn = 16 if bits == 8 else 8
    if whole_rows:
        return QGemvConfig(bn, bk, 4, 1, 1 if tiles == 1 else 3)
    return QGemvConfig(bn, bk, 4, tiles, 1)


def _fast(q: torch.Tensor, bits: int, K: int) -> bool:
    """The PTX path (GPU) reads the codes as 32-bit words: rows 4-byte aligned and whole words."""
    return q.is_cuda and q.data_ptr() % 4 == 0 and q.stride(0) % 4 == 0 and triton.cdiv(K * bits, 8) % 4 == 0


class PdlMode(NamedTuple):
    """How the kernels launch on sm_90+ (module doc, PDL). trigger: "wait" (the next kernel may launch once our
    wait has returned), "late" (once our main loop is done) or "none" (plain launches: only the prefetch, and only
    in the kernels with the RMSNorm prologue, whose first weight loads otherwise wait for x's loads and the rstd
    reduction); prefetch: tiles of a program's weights prefetched into L2 first (0: none; more than a program has:
    all of them)."""
    trigger: str = "wait"
    prefetch: int = 1


# The mode by code width, as measured in the engine (tools.bench.quant_pdl, quant_roles): the int4 step gains with
# the trigger after the wait; int8's GEMVs, closer to the bandwidth, ran slower beside an early-launched successor
# than the overlap saved, and gain only with the trigger after the main loop and the 1-tile prefetch.
PDL_DEFAULT: Mapping[int, PdlMode | None] = MappingProxyType({4: PdlMode("wait", 1), 8: PdlMode("late", 1)})


def _pdl_kwargs(mode: PdlMode | None | str, q: torch.Tensor, cfg: QGemvConfig, bits: int, program_bytes: int,
                rope: bool, norm: bool = True) -> dict:
    """The PDL constexprs and launch option for `mode` ("default": PDL_DEFAULT's; none off sm_90 or under the
    interpreter) for a kernel with (norm) or without the RMSNorm prologue. Without PDL the qkv + RoPE kernel still
    lets its dependents launch at its start: the decode attention, PDL-launched over long caches."""
    if not pdl_available(q):
        return {}
    mode = PDL_DEFAULT.get(bits) if mode == "default" else mode
    plain = dict(TRIGGER=1) if rope else {}
    if mode is None:
        return plain
    assert mode.trigger in ("wait", "late", "none") and mode.prefetch >= 0, mode
    nbytes = min(mode.prefetch * cfg.block_k * bits // 8, program_bytes)
    lines = triton.next_power_of_2(triton.cdiv(nbytes, 128)) if nbytes else 0
    if mode.trigger == "none":
        return dict(plain, PF_LINES=lines) if norm and lines else plain
    return dict(PDL=True, TRIGGER=1 if mode.trigger == "wait" else 2, PF_LINES=lines, launch_pdl=True)


def _launch_checks(cfg: QGemvConfig, bits: int, group: int, per_row: bool, K: int = 0) -> None:
    chunk = 128 // bits
    assert cfg.block_k % chunk == 0, f"block_k {cfg.block_k}: whole {chunk}-column chunks (16 bytes)"
    assert per_row or group % chunk == 0, f"group {group}: whole {chunk}-column chunks"
    assert not cfg.programs or (cfg.split_k == 1 and cfg.block_k >= K), "persistent: one K slice, one tile a row"


def _persist_kwargs(cfg: QGemvConfig, blocks: int, scale: torch.Tensor, per_row: bool) -> tuple[tuple, dict]:
    """The grid and constexprs: one program a row block (and K slice), or cfg.programs persistent ones, which
    prefetch each next row block's scale lines (SLINES a row; on the GPU: the interpreter has no prefetch)."""
    if not cfg.programs:
        return (blocks,), {}
    row_bytes = scale.shape[1] * scale.element_size()
    slines = 0 if per_row or not scale.is_cuda else triton.next_power_of_2(triton.cdiv(row_bytes, 128))
    return (min(cfg.programs, blocks),), dict(PERSIST=True, SLINES=slines)


def qgemv_fwd(q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor | None, bits: int, offset: int, group: int,
              K: int, x: torch.Tensor, *, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
              swiglu: bool = False, residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
              config: QGemvConfig | tuple | None = None, pdl: PdlMode | None | str = "default") -> torch.Tensor:
    """y = [residual +] W @ f(x) for the quantized W [N, K] (module doc), x [K] or [1, K] ([2K] with swiglu)
    -> [1, N] in x's dtype (or `out`); f and the epilogue as accel.kernels.gemv.gemv_fwd. pdl: a PdlMode, None
    (plain launches) or "default" (PDL_DEFAULT's for the code width)."""
    N = q.shape[0]
    assert q.stride(1) == 1 and scale.stride(1) == 1 and (low is None or low.stride() == scale.stride())
    xv = x.reshape(-1)
    assert xv.stride(0) == 1 and xv.numel() == (2 * K if swiglu else K), "x must be contiguous [K] (swiglu: [2K])"
    assert not (swiglu and norm_weight is not None), "one prologue at a time"
    out = torch.empty((1, N), dtype=x.dtype, device=x.device) if out is None else out
    per_row = group >= K and low is None  # one scale a row, applied after the sum (with minima: the group path)
    cfg = QGemvConfig(*config) if config is not None else qgemv_config(N, K, bits, group, sm_count(q.device))
    _launch_checks(cfg, bits, group, per_row, K)
    prologue = PROLOGUE_SWIGLU if swiglu else PROLOGUE_NORM if norm_weight is not None else PROLOGUE_NONE
    blocks = triton.cdiv(N, cfg.block_n)
    k_split = triton.cdiv(triton.cdiv(K, cfg.split_k), cfg.block_k) * cfg.block_k
    split = triton.cdiv(K, k_split)
    pack = 8 // bits
    p, c = split_scratch(q.device, split * N, blocks) if split > 1 else (out, out)
    grid, persist = _persist_kwargs(cfg, blocks, scale, per_row)
    _qgemv_kernel[grid + (split,)](
        q, scale, low if low is not None else scale, xv, norm_weight if norm_weight is not None else xv,
        residual if residual is not None else out, out, p, c, N, K, triton.cdiv(K, pack), q.stride(0),
        scale.stride(0), float(eps), scale.shape[1], k_split // pack, BITS=bits, OFFSET=offset, GROUP=group,
        HAS_MIN=low is not None, PER_ROW=per_row, PROLOGUE=prologue, HAS_RESIDUAL=residual is not None,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        K_POW2=triton.next_power_of_2(K) if prologue == PROLOGUE_NORM else 1, SPLIT_K=split, STAGES=cfg.stages,
        FAST=_fast(q, bits, K), num_warps=cfg.warps, num_stages=cfg.stages, **persist,
        **_pdl_kwargs(pdl, q, cfg, bits, k_split // pack, rope=False, norm=prologue == PROLOGUE_NORM))
    return out


def qkv_rope_qfwd(q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor | None, bits: int, offset: int,
                  group: int, K: int, x: torch.Tensor, norm_weight: torch.Tensor, eps: float, cos: torch.Tensor,
                  sin: torch.Tensor, position: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
                  q_out: torch.Tensor | None = None, config: QGemvConfig | tuple | None = None,
                  pdl: PdlMode | None | str = "default") -> torch.Tensor:
    """accel.kernels.qkv_rope.qkv_rope_fwd for the quantized W [(H+2K)·E, D] (module doc): one launch, the same
    roundings -> q_rot [1, H, E]; rope(k) and v written to slot `position` of the caches. pdl: as qgemv_fwd."""
    NKV, S, E = cache_k.shape
    N = q.shape[0]
    H = N // E - 2 * NKV
    assert H > 0 and N == (H + 2 * NKV) * E and E % 2 == 0, "weight rows must be (H + 2K)·E"
    assert q.stride(1) == 1 and scale.stride(1) == 1 and (low is None or low.stride() == scale.stride())
    assert x.numel() == K and x.reshape(-1).stride(0) == 1
    assert norm_weight.shape == (K,) and norm_weight.stride(0) == 1
    assert cache_v.shape == cache_k.shape and cache_k.stride(2) == 1 and cache_v.stride(2) == 1
    assert cos.shape == (S, E // 2) and cos.stride(1) == 1 and sin.stride(1) == 1 and position.numel() == 1
    q_out = torch.empty((1, H, E), dtype=x.dtype, device=x.device) if q_out is None else q_out
    assert q_out.is_contiguous() and q_out.numel() == H * E
    per_row = group >= K and low is None
    cfg = QGemvConfig(*config) if config is not None else qgemv_config(N, K, bits, group, sm_count(q.device), True)
    _launch_checks(cfg, bits, group, per_row)
    hn = cfg.block_n // 2
    assert hn >= 1 and hn == triton.next_power_of_2(hn), f"block_n {cfg.block_n}: twice a power of 2"
    assert not cfg.programs, "the qkv + RoPE kernel takes one program a head block"
    _qkv_rope_kernel[((H + 2 * NKV) * triton.cdiv(E // 2, hn),)](
        q, scale, low if low is not None else scale, x, norm_weight, cos, sin, position, q_out, cache_k, cache_v, K,
        triton.cdiv(K, 8 // bits), q.stride(0), scale.stride(0), float(eps), scale.shape[1], cos.stride(0),
        sin.stride(0), cache_k.stride(0), cache_k.stride(1), cache_v.stride(0), cache_v.stride(1), H, NKV, E=E,
        BITS=bits, OFFSET=offset, GROUP=group, HAS_MIN=low is not None, PER_ROW=per_row, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, K_POW2=triton.next_power_of_2(K), STAGES=cfg.stages, FAST=_fast(q, bits, K),
        num_warps=cfg.warps, num_stages=cfg.stages, **_pdl_kwargs(pdl, q, cfg, bits, q.shape[1], rope=True))
    return q_out


def gate_up_swiglu_qfwd(q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor | None, bits: int, offset: int,
                        group: int, K: int, x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                        out: torch.Tensor | None = None, config: QGemvConfig | tuple | None = None,
                        pdl: PdlMode | None | str = "default") -> torch.Tensor:
    """swiglu(gate, up) of linear(rms_norm(x), W) for the quantized W [2F, K] (rows gate, then up): one launch,
    the roundings of the unfused GEMV then accel.kernels.swiglu -> [1, F] in x's dtype. A program owns whole
    rows (the launch table's row for W when it does not split K, else the rule's unsplit config: the SwiGLU needs
    both sums complete). pdl: as qgemv_fwd."""
    N = q.shape[0]
    F = N // 2
    assert N == 2 * F, "weight rows must be 2F (gate, then up)"
    assert q.stride(1) == 1 and scale.stride(1) == 1 and (low is None or low.stride() == scale.stride())
    assert x.numel() == K and x.reshape(-1).stride(0) == 1
    assert norm_weight.shape == (K,) and norm_weight.stride(0) == 1
    out = torch.empty((1, F), dtype=x.dtype, device=x.device) if out is None else out
    per_row = group >= K and low is None
    if config is not None:
        cfg = QGemvConfig(*config)
    else:
        cfg = qgemv_config(N, K, bits, group, sm_count(q.device))
        if cfg.split_k != 1:
            cfg = qgemv_config(N, K, bits, group, sm_count(q.device), whole_rows=True, table={})
    _launch_checks(cfg, bits, group, per_row, K)
    hn = cfg.block_n // 2
    assert hn >= 1 and hn == triton.next_power_of_2(hn), f"block_n {cfg.block_n}: twice a power of 2"
    grid, persist = _persist_kwargs(cfg, triton.cdiv(F, hn), scale, per_row)
    _gate_up_swiglu_kernel[grid](
        q, scale, low if low is not None else scale, x, norm_weight, out, F, K, triton.cdiv(K, 8 // bits),
        q.stride(0), scale.stride(0), float(eps), scale.shape[1], BITS=bits, OFFSET=offset, GROUP=group,
        HAS_MIN=low is not None, PER_ROW=per_row, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        K_POW2=triton.next_power_of_2(K), STAGES=cfg.stages, FAST=_fast(q, bits, K), num_warps=cfg.warps,
        num_stages=cfg.stages, **persist, **_pdl_kwargs(pdl, q, cfg, bits, q.shape[1], rope=False))
    return out
