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
(gemv.py's split kernel does the same). Persistent programs (QGemvConfig.programs = P > 0; one K slice, one tile
a row): program b takes row blocks b, b + P, b + 2P, ... through the STAGES-deep cp.async pipeline, so the next
blocks' codes are in flight while this one is multiplied; f(x)'s fixed point is built once a program (not once a
row block), and before each block the next block's scale (and minimum) lines are prefetched into L2 (SLINES: those
small loads are outside the pipeline). The same sums in the same order: only which program computes a row changes.
The decode step's two fused epilogues (qkv + RoPE + cache write, gate_up + SwiGLU) reuse this body:
accel/kernels/qgemv_fused.py. Launch configs: accel/kernels/tuning.py's QGEMV, else `qgemv_config`'s rule.

PDL (programmatic dependent launch, sm_90+; a tuning.PdlMode, by code width: tuning.QGEMV_PDL): each of
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

from typing import Mapping

import torch
import triton
import triton.language as tl

from . import tuning
from .common import (PROLOGUE_NONE, PROLOGUE_NORM, PROLOGUE_SWIGLU, epilogue, gdc_launch_dependents, gdc_wait,
                     pdl_available, pdl_kw, per_row_scales, prefetch_l2, prefetch_rows_l2, prologue_fx, rms_rstd,
                     sm_count, split_k_epilogue, split_scratch)
from .qdot import chunk_dots, fixed_point, group_param
from .tuning import PdlMode, QGemvConfig


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
def pdl_start(Q, S, M, rows_c, kb_lo, kb_hi, stride_q, stride_s, BITS: tl.constexpr, GROUP: tl.constexpr,
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
def rows_dot(Q, S, M, X, NW, rows_c, kb_lo, kb_hi, K, KB, stride_q, stride_s, eps, n_groups, BITS: tl.constexpr,
              OFFSET: tl.constexpr, GROUP: tl.constexpr, HAS_MIN: tl.constexpr, PER_ROW: tl.constexpr,
              PROLOGUE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_POW2: tl.constexpr,
              STAGES: tl.constexpr, FAST: tl.constexpr, PDL: tl.constexpr, TRIGGER: tl.constexpr,
              PF_LINES: tl.constexpr):
    """A kernel's body up to its epilogue: `pdl_start`, `_qdot` over bytes kb_lo .. kb_hi of rows_c, and with
    TRIGGER 2 the next kernel's launch after the main loop -> [BLOCK_N] fp32."""
    pdl_start(Q, S, M, rows_c, kb_lo, kb_hi, stride_q, stride_s, BITS, GROUP, HAS_MIN, PDL, TRIGGER, PF_LINES)
    acc = _qdot(Q, S, M, X, NW, rows_c, kb_lo, kb_hi, K, KB, stride_q, stride_s, eps, n_groups, BITS, OFFSET, GROUP,
                HAS_MIN, PER_ROW, PROLOGUE, BLOCK_N, BLOCK_K, K_POW2, STAGES, FAST)
    if TRIGGER == 2:
        gdc_launch_dependents()
    return acc


@triton.jit
def whole_row_fx(X, NW, K, eps, BITS: tl.constexpr, OFFSET: tl.constexpr, HAS_MIN: tl.constexpr,
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
def block_sums(Q, S, M, rows_c, next_c, KB, stride_q, stride_s, n_groups, F, unit, xc, BITS: tl.constexpr,
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
def _qgemv_kernel(Q, S, M, X, NW, R, Y, P, CNT, N, K, KB, stride_q, stride_s, eps, n_groups, kb_split,
                  BITS: tl.constexpr, OFFSET: tl.constexpr, GROUP: tl.constexpr, HAS_MIN: tl.constexpr,
                  PER_ROW: tl.constexpr, PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, K_POW2: tl.constexpr, SPLIT_K: tl.constexpr, STAGES: tl.constexpr,
                  FAST: tl.constexpr,
                  PDL: tl.constexpr = False, TRIGGER: tl.constexpr = 0, PF_LINES: tl.constexpr = 0,
                  PERSIST: tl.constexpr = False, SLINES: tl.constexpr = 0):
    """Program (row block b, K slice s): rows b·BN .. (b+1)·BN over bytes s·kb_split .. (s+1)·kb_split of Q.
    PERSIST (one K slice, one tile a row): program b takes row blocks b, b + programs, ... through a STAGES-deep
    cp.async pipeline, f(x)'s fixed point built once; SLINES: `block_sums`. PDL, TRIGGER, PF_LINES: `pdl_start`."""
    b = tl.program_id(0)
    if PERSIST:
        step = tl.num_programs(0)
        pdl_start(Q, S, M, tl.minimum(b * BLOCK_N + tl.arange(0, BLOCK_N), N - 1).to(tl.int64), 0, KB, stride_q,
                   stride_s, BITS, GROUP, HAS_MIN, PDL, TRIGGER, PF_LINES)
        F, unit, xc = whole_row_fx(X, NW, K, eps, BITS, OFFSET, HAS_MIN, PROLOGUE, BLOCK_K, K_POW2)
        for blk in tl.range(b, tl.cdiv(N, BLOCK_N), step, num_stages=STAGES):
            rows = blk * BLOCK_N + tl.arange(0, BLOCK_N)
            rows_c = tl.minimum(rows, N - 1).to(tl.int64)
            acc = block_sums(Q, S, M, rows_c, tl.minimum(rows + step * BLOCK_N, N - 1).to(tl.int64), KB, stride_q,
                              stride_s, n_groups, F, unit, xc, BITS, OFFSET, GROUP, HAS_MIN, PER_ROW, BLOCK_N,
                              BLOCK_K, FAST, SLINES)
            epilogue(acc, R, Y, rows, N, HAS_RESIDUAL)
        if TRIGGER == 2:
            gdc_launch_dependents()
    else:
        _slice_block(Q, S, M, X, NW, R, Y, P, CNT, b, tl.program_id(1), N, K, KB, stride_q, stride_s, eps, n_groups,
                     kb_split, BITS, OFFSET, GROUP, HAS_MIN, PER_ROW, PROLOGUE, HAS_RESIDUAL, BLOCK_N, BLOCK_K, K_POW2,
                     SPLIT_K, STAGES, FAST, PDL, TRIGGER, PF_LINES)


@triton.jit
def _slice_block(Q, S, M, X, NW, R, Y, P, CNT, b, sp, N, K, KB, stride_q, stride_s, eps, n_groups, kb_split,
                 BITS: tl.constexpr, OFFSET: tl.constexpr, GROUP: tl.constexpr, HAS_MIN: tl.constexpr,
                 PER_ROW: tl.constexpr, PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, K_POW2: tl.constexpr, SPLIT_K: tl.constexpr, STAGES: tl.constexpr,
                 FAST: tl.constexpr, PDL: tl.constexpr, TRIGGER: tl.constexpr, PF_LINES: tl.constexpr):
    """Row block b over K slice sp (bytes sp·kb_split ..), then the (split-K) epilogue."""
    rows = b * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_c = tl.minimum(rows, N - 1).to(tl.int64)  # rows past N re-read row N-1; the stores are masked
    kb_lo = sp * kb_split
    acc = rows_dot(Q, S, M, X, NW, rows_c, kb_lo, tl.minimum(kb_lo + kb_split, KB), K, KB, stride_q, stride_s, eps,
                    n_groups, BITS, OFFSET, GROUP, HAS_MIN, PER_ROW, PROLOGUE, BLOCK_N, BLOCK_K, K_POW2, STAGES, FAST,
                    PDL, TRIGGER, PF_LINES)
    split_k_epilogue(acc, P, CNT, R, Y, rows, N, sp, b, SPLIT_K, HAS_RESIDUAL)


def qgemv_config(N: int, K: int, bits: int, group: int, sms: int, whole_rows: bool = False,
                 table: Mapping[tuple, QGemvConfig] = tuning.QGEMV) -> QGemvConfig:
    """`table`'s row for (N, K, bits, group) on a GPU, else the rule: ONE tile a program (all its loads issued at
    once, like gemv.py's "split" kind) of 2048, 1024 or 512 bytes of a row (16 B a lane, warps along K, so each
    thread's f(x) serves all its rows; the widest that divides the row), 16 rows (8 at 4 bits: twice the codes
    a byte), split-K over the tiles. whole_rows: a program owns whole rows, no split-K (the qkv + RoPE kernel, its
    table rows tagged "rope", and the gate_up + SwiGLU kernel): its tiles go through a 3-stage cp.async pipeline
    instead. A table row may set `programs` (P > 0: persistent, module doc): one K slice and one tile a row, P
    programs each looping over every P-th row block (the rule never does). On CPU (the interpreter, whose cost is
    per program and per op): one big tile."""
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


def fast_path(q: torch.Tensor, bits: int, K: int) -> bool:
    """The PTX path (GPU) reads the codes as 32-bit words: rows 4-byte aligned and whole words."""
    return q.is_cuda and q.data_ptr() % 4 == 0 and q.stride(0) % 4 == 0 and triton.cdiv(K * bits, 8) % 4 == 0


def pdl_kwargs(mode: PdlMode | None | str, q: torch.Tensor, cfg: QGemvConfig, bits: int, program_bytes: int,
                rope: bool) -> dict:
    """The PDL constexprs and launch option for `mode` ("default": tuning.QGEMV_PDL's; None: plain launches; none off
    sm_90 or under the interpreter). Launched plainly, the qkv + RoPE kernel still lets its dependents launch at
    its start: the decode attention, PDL-launched over long caches."""
    if not pdl_available(q):
        return {}
    mode = tuning.QGEMV_PDL.get(bits) if mode == "default" else mode
    if mode is None:
        return dict(TRIGGER=1) if rope else {}
    assert mode.trigger in ("wait", "late") and mode.prefetch >= 0, mode
    nbytes = min(mode.prefetch * cfg.block_k * bits // 8, program_bytes)
    lines = triton.next_power_of_2(triton.cdiv(nbytes, 128)) if nbytes else 0
    return dict(PDL=True, TRIGGER=1 if mode.trigger == "wait" else 2, PF_LINES=lines, **pdl_kw(True))


def k_slices(cfg: QGemvConfig, K: int) -> tuple[int, int]:
    """(columns a K slice: whole tiles, slices) of cfg's split-K over K columns."""
    k_split = triton.cdiv(triton.cdiv(K, cfg.split_k), cfg.block_k) * cfg.block_k
    return k_split, triton.cdiv(K, k_split)


def check_operands(q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor | None, x: torch.Tensor | None = None,
              n: int = 0, norm_weight: torch.Tensor | None = None) -> None:
    """The launchers' checks on their operands: the weight's codes, scales (and minima) with contiguous rows; x
    (if given) contiguous with n elements; the norm weight (if given) contiguous [n]."""
    assert q.stride(1) == 1 and scale.stride(1) == 1 and (low is None or low.stride() == scale.stride())
    if x is not None:
        assert x.numel() == n and x.reshape(-1).stride(0) == 1, f"x must be contiguous with {n} elements"
    if norm_weight is not None:
        assert norm_weight.shape == (n,) and norm_weight.stride(0) == 1, f"the norm weight must be contiguous [{n}]"


def launch_checks(cfg: QGemvConfig, bits: int, group: int, per_row: bool, K: int) -> None:
    chunk = 128 // bits
    assert cfg.block_k % chunk == 0, f"block_k {cfg.block_k}: whole {chunk}-column chunks (16 bytes)"
    assert per_row or group % chunk == 0, f"group {group}: whole {chunk}-column chunks"
    assert not cfg.programs or (cfg.split_k == 1 and cfg.block_k >= K), "persistent: one K slice, one tile a row"


def persist_kwargs(cfg: QGemvConfig, blocks: int, scale: torch.Tensor, per_row: bool) -> tuple[tuple, dict]:
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
              config: QGemvConfig | tuple | None = None, table: Mapping[tuple, QGemvConfig] = tuning.QGEMV,
              pdl: PdlMode | None | str = "default") -> torch.Tensor:
    """y = [residual +] W @ f(x) for the quantized W [N, K] (module doc), x [K] or [1, K] ([2K] with swiglu)
    -> [1, N] in x's dtype (or `out`); f and the epilogue as accel.kernels.gemv.gemv_fwd. config: else `table`'s
    row or the rule (qgemv_config). pdl: a PdlMode, None (plain launches) or "default" (tuning.QGEMV_PDL's for the
    code width)."""
    N = q.shape[0]
    xv = x.reshape(-1)
    check_operands(q, scale, low, xv, 2 * K if swiglu else K)
    assert not (swiglu and norm_weight is not None), "one prologue at a time"
    out = torch.empty((1, N), dtype=x.dtype, device=x.device) if out is None else out
    per_row = per_row_scales(group, K, low)
    cfg = QGemvConfig(*config) if config is not None else qgemv_config(N, K, bits, group, sm_count(q.device),
                                                                       table=table)
    launch_checks(cfg, bits, group, per_row, K)
    prologue = PROLOGUE_SWIGLU if swiglu else PROLOGUE_NORM if norm_weight is not None else PROLOGUE_NONE
    blocks = triton.cdiv(N, cfg.block_n)
    k_split, split = k_slices(cfg, K)
    pack = 8 // bits
    p, c = split_scratch(q.device, split * N, blocks) if split > 1 else (out, out)
    grid, persist = persist_kwargs(cfg, blocks, scale, per_row)
    _qgemv_kernel[grid + (split,)](
        q, scale, low if low is not None else scale, xv, norm_weight if norm_weight is not None else xv,
        residual if residual is not None else out, out, p, c, N, K, triton.cdiv(K, pack), q.stride(0),
        scale.stride(0), float(eps), scale.shape[1], k_split // pack, BITS=bits, OFFSET=offset, GROUP=group,
        HAS_MIN=low is not None, PER_ROW=per_row, PROLOGUE=prologue, HAS_RESIDUAL=residual is not None,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        K_POW2=triton.next_power_of_2(K) if prologue == PROLOGUE_NORM else 1, SPLIT_K=split, STAGES=cfg.stages,
        FAST=fast_path(q, bits, K), num_warps=cfg.warps, num_stages=cfg.stages, **persist,
        **pdl_kwargs(pdl, q, cfg, bits, k_split // pack, rope=False))
    return out
