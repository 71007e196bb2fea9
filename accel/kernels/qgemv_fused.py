"""The quantized decode GEMV (accel/kernels/qgemv.py) with the decode step's two fused epilogues, one launch each.

qkv + RoPE + KV-cache write (`qkv_rope_qfwd`: accel/kernels/qkv_rope.py's epilogue) and gate_up + SwiGLU
(`gate_up_swiglu_qfwd`): a program owns whole rows in pairs — a head's two halves, or gate row i and up row F + i —
so the epilogue has both sums of a pair; no rearranging of the weights. The body up to the epilogue, the launch
configs and the PDL modes are qgemv.py's (its module doc): its helpers (`rows_dot`, `whole_row_fx`, `block_sums`,
`pdl_start`, ...) are one body for all three kernels.
gate_up + SwiGLU can also run persistent (a config with `programs` > 0, as qgemv.py's: P programs looping over
row-pair blocks, f(x)'s fixed point built once a program); qkv + RoPE cannot (a program owns one head's pair).
Configs come through `qgemv.qgemv_config` (the table a Tuning carries, else the rule), as qgemv_fwd's.
"""
from __future__ import annotations

from typing import Mapping

import torch
import triton
import triton.language as tl

from . import qgemv
from .common import gdc_launch_dependents, per_row_scales, sm_count
from .qgemv import (block_sums, check_operands, fast_path, launch_checks, pdl_kwargs, pdl_start, persist_kwargs,
                    rows_dot, whole_row_fx)
from .qkv_rope import rope_store
from .tuning import QGEMV, PdlMode, QGemvConfig


@triton.jit
def _halves(acc, HN: tl.constexpr):
    """[2·HN] sums of a paired-rows program (its first HN rows, then the HN rows they pair with) -> the two [HN]."""
    return tl.split(tl.permute(tl.reshape(acc, [2, HN]), [1, 0]))


@triton.jit
def _qkv_rope_kernel(Q, S, M, X, NW, COS, SIN, POS, QO, CK, CV, K, KB, stride_q, stride_s, eps, n_groups, s_cos,
                     s_sin, sc_k, sc_s, scv_k, scv_s, H, NKV, E: tl.constexpr, BITS: tl.constexpr,
                     OFFSET: tl.constexpr, GROUP: tl.constexpr, HAS_MIN: tl.constexpr, PER_ROW: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_POW2: tl.constexpr, STAGES: tl.constexpr,
                     FAST: tl.constexpr,
                     PDL: tl.constexpr = False, TRIGGER: tl.constexpr = 0, PF_LINES: tl.constexpr = 0):
    """accel/kernels/qkv_rope.py's norm + qkv + RoPE + cache write for a quantized weight: a program's BLOCK_N
    rows are BLOCK_N/2 columns of the first half of one head and the matching BLOCK_N/2 of its second half.
    PDL, TRIGGER, PF_LINES: `pdl_start` (TRIGGER 1 without PDL: at once, for the decode attention after us)."""
    half: tl.constexpr = E // 2
    HN: tl.constexpr = BLOCK_N // 2
    per_head: tl.constexpr = (half + HN - 1) // HN
    b = tl.program_id(0)
    head = b // per_head  # over the H + 2·NKV heads of the fused output: q heads, then k, then v
    i = tl.arange(0, BLOCK_N)
    c = (b % per_head) * HN + i % HN  # [BN] the column in the head's first half
    rows_c = (head * E + tl.minimum(c, half - 1) + (i // HN) * half).to(tl.int64)  # tail columns re-read a row
    acc = rows_dot(Q, S, M, X, NW, rows_c, 0, KB, K, KB, stride_q, stride_s, eps, n_groups, BITS, OFFSET, GROUP,
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
    PERSIST, SLINES: as `_qgemv_kernel`'s. PDL, TRIGGER, PF_LINES: `pdl_start`."""
    HN: tl.constexpr = BLOCK_N // 2
    b = tl.program_id(0)
    i = tl.arange(0, BLOCK_N)
    if PERSIST:
        step = tl.num_programs(0)
        pdl_start(Q, S, M, _pair_rows(b, i, F, HN), 0, KB, stride_q, stride_s, BITS, GROUP, HAS_MIN, PDL, TRIGGER,
                   PF_LINES)
        Fx, unit, xc = whole_row_fx(X, NW, K, eps, BITS, OFFSET, HAS_MIN, 1, BLOCK_K, K_POW2)
        for blk in tl.range(b, tl.cdiv(F, HN), step, num_stages=STAGES):
            acc = block_sums(Q, S, M, _pair_rows(blk, i, F, HN), _pair_rows(blk + step, i, F, HN), KB, stride_q,
                              stride_s, n_groups, Fx, unit, xc, BITS, OFFSET, GROUP, HAS_MIN, PER_ROW, BLOCK_N,
                              BLOCK_K, FAST, SLINES)
            _swiglu_store(acc, Y, blk, F, HN)
        if TRIGGER == 2:
            gdc_launch_dependents()
    else:
        _gate_up_block(Q, S, M, X, NW, Y, b, F, K, KB, stride_q, stride_s, eps, n_groups, BITS, OFFSET, GROUP,
                      HAS_MIN, PER_ROW, BLOCK_N, BLOCK_K, K_POW2, STAGES, FAST, PDL, TRIGGER, PF_LINES)


@triton.jit
def _gate_up_block(Q, S, M, X, NW, Y, b, F, K, KB, stride_q, stride_s, eps, n_groups, BITS: tl.constexpr,
                  OFFSET: tl.constexpr, GROUP: tl.constexpr, HAS_MIN: tl.constexpr, PER_ROW: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_POW2: tl.constexpr, STAGES: tl.constexpr,
                  FAST: tl.constexpr, PDL: tl.constexpr, TRIGGER: tl.constexpr, PF_LINES: tl.constexpr):
    """One program's work of the unpersisted kernel: row-pair block b
    (`_pair_rows`) over whole rows with the norm prologue, silu(gate)·up stored to Y."""
    HN: tl.constexpr = BLOCK_N // 2
    acc = rows_dot(Q, S, M, X, NW, _pair_rows(b, tl.arange(0, BLOCK_N), F, HN), 0, KB, K, KB, stride_q, stride_s,
                    eps, n_groups, BITS, OFFSET, GROUP, HAS_MIN, PER_ROW, 1, BLOCK_N, BLOCK_K, K_POW2, STAGES, FAST,
                    PDL, TRIGGER, PF_LINES)
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


def half_block(cfg: QGemvConfig) -> int:
    """The rows a paired-rows program owns of each half (its block_n: twice a power of 2)."""
    hn = cfg.block_n // 2
    assert hn >= 1 and hn == triton.next_power_of_2(hn), f"block_n {cfg.block_n}: twice a power of 2"
    return hn


def gate_up_config(N: int, K: int, bits: int, group: int, sms: int,
                   table: Mapping[tuple, QGemvConfig] = QGEMV) -> QGemvConfig:
    """gate_up + SwiGLU's launch config: the table's row for W [N, K] when it does not split K, else the rule's
    unsplit config (the SwiGLU needs both sums complete)."""
    cfg = qgemv.qgemv_config(N, K, bits, group, sms, table=table)
    return cfg if cfg.split_k == 1 else qgemv.qgemv_config(N, K, bits, group, sms, whole_rows=True, table={})


def qkv_rope_qfwd(q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor | None, bits: int, offset: int,
                  group: int, K: int, x: torch.Tensor, norm_weight: torch.Tensor, eps: float, cos: torch.Tensor,
                  sin: torch.Tensor, position: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
                  q_out: torch.Tensor | None = None, config: QGemvConfig | tuple | None = None,
                  table: Mapping[tuple, QGemvConfig] = QGEMV, pdl: PdlMode | None | str = "default") -> torch.Tensor:
    """accel.kernels.qkv_rope.qkv_rope_fwd for the quantized W [(H+2K)·E, D] (module doc): one launch, the same
    roundings -> q_rot [1, H, E]; rope(k) and v written to slot `position` of the caches. table, pdl: as
    qgemv_fwd's."""
    NKV, S, E = cache_k.shape
    N = q.shape[0]
    H = N // E - 2 * NKV
    assert H > 0 and N == (H + 2 * NKV) * E and E % 2 == 0, "weight rows must be (H + 2K)·E"
    check_operands(q, scale, low, x, K, norm_weight)
    assert cache_v.shape == cache_k.shape and cache_k.stride(2) == 1 and cache_v.stride(2) == 1
    assert cos.shape == (S, E // 2) and cos.stride(1) == 1 and sin.stride(1) == 1 and position.numel() == 1
    q_out = torch.empty((1, H, E), dtype=x.dtype, device=x.device) if q_out is None else q_out
    assert q_out.is_contiguous() and q_out.numel() == H * E
    per_row = per_row_scales(group, K, low)
    cfg = (QGemvConfig(*config) if config is not None
           else qgemv.qgemv_config(N, K, bits, group, sm_count(q.device), whole_rows=True, table=table))
    launch_checks(cfg, bits, group, per_row, K)
    hn = half_block(cfg)
    assert not cfg.programs, "the qkv + RoPE kernel takes one program a head block"
    _qkv_rope_kernel[((H + 2 * NKV) * triton.cdiv(E // 2, hn),)](
        q, scale, low if low is not None else scale, x, norm_weight, cos, sin, position, q_out, cache_k, cache_v, K,
        triton.cdiv(K, 8 // bits), q.stride(0), scale.stride(0), float(eps), scale.shape[1], cos.stride(0),
        sin.stride(0), cache_k.stride(0), cache_k.stride(1), cache_v.stride(0), cache_v.stride(1), H, NKV, E=E,
        BITS=bits, OFFSET=offset, GROUP=group, HAS_MIN=low is not None, PER_ROW=per_row, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, K_POW2=triton.next_power_of_2(K), STAGES=cfg.stages, FAST=fast_path(q, bits, K),
        num_warps=cfg.warps, num_stages=cfg.stages, **pdl_kwargs(pdl, q, cfg, bits, q.shape[1], rope=True))
    return q_out


def gate_up_swiglu_qfwd(q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor | None, bits: int, offset: int,
                        group: int, K: int, x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                        out: torch.Tensor | None = None, config: QGemvConfig | tuple | None = None,
                        table: Mapping[tuple, QGemvConfig] = QGEMV,
                        pdl: PdlMode | None | str = "default") -> torch.Tensor:
    """swiglu(gate, up) of linear(rms_norm(x), W) for the quantized W [2F, K] (rows gate, then up): one launch,
    the roundings of the unfused GEMV then accel.kernels.swiglu -> [1, F] in x's dtype. A program owns whole
    rows (the launch table's row for W when it does not split K, else the rule's unsplit config: the SwiGLU needs
    both sums complete). table, pdl: as qgemv_fwd's."""
    N = q.shape[0]
    F = N // 2
    assert N == 2 * F, "weight rows must be 2F (gate, then up)"
    check_operands(q, scale, low, x, K, norm_weight)
    out = torch.empty((1, F), dtype=x.dtype, device=x.device) if out is None else out
    per_row = per_row_scales(group, K, low)
    cfg = (QGemvConfig(*config) if config is not None
           else gate_up_config(N, K, bits, group, sm_count(q.device), table))
    launch_checks(cfg, bits, group, per_row, K)
    hn = half_block(cfg)
    grid, persist = persist_kwargs(cfg, triton.cdiv(F, hn), scale, per_row)
    _gate_up_swiglu_kernel[grid](
        q, scale, low if low is not None else scale, x, norm_weight, out, F, K, triton.cdiv(K, 8 // bits),
        q.stride(0), scale.stride(0), float(eps), scale.shape[1], BITS=bits, OFFSET=offset, GROUP=group,
        HAS_MIN=low is not None, PER_ROW=per_row, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        K_POW2=triton.next_power_of_2(K), STAGES=cfg.stages, FAST=fast_path(q, bits, K), num_warps=cfg.warps,
        num_stages=cfg.stages, **persist, **pdl_kwargs(pdl, q, cfg, bits, q.shape[1], rope=False))
    return out
