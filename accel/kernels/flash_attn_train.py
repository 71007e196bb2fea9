"""FlashAttention for training, in Triton: a forward that saves the log-sum-exp, and its backward. Native GQA.

Layout: q [B, T, H, E], k/v [B, S, K, E] (head rows contiguous), mask [B, T, S] bool (True = may attend; any
strides, so an expanded [B, 1, S] padding mask costs nothing) or None. Query t of head h attends key s of kv head
h // (H/K) when mask[b, t, s] and, if causal, s <= t (top-left aligned, as torch SDPA's is_causal). Scale 1/sqrt(E).
A row that sees no key outputs 0, its log-sum-exp is +inf, and so its probabilities, and every gradient through it,
are 0. Scores and softmax in fp32, in the exp2 domain (raw scores scaled by log2(e)/sqrt(E)); the saved
log-sum-exp is in that domain too: lse2[b, h, t] = log2 Σ_s exp2(score2[t, s]).

Backward (FlashAttention-2 with Δ precomputed; no atomics, so bit-for-bit deterministic):
  * dQ pass: one program = BLOCK_M queries of one query head. It first computes Δ = rowsum(O · dO) for its rows
    (stored for the next pass), then recomputes P blockwise from the saved lse and accumulates dQ = dS · K.
  * dK/dV pass: one program = BLOCK_N keys of one kv head. It loops over the H/K query heads of the group and
    their query blocks, accumulating dV = Pᵀ · dO and dK = dSᵀ · Q in fp32 registers: each K/V tile is read once
    for the whole group, and repeated K/V never exist in memory. Where the pass has too few programs for the GPU
    (short sequences), SPLIT gives a group's heads to several programs whose fp32 partial dK/dV are summed in a
    fixed order afterwards; those programs walk (head, query block) pairs in one flat loop.
Both passes split their loop as the inference forward does: blocks every row fully sees (no causal mask, no bounds
checks) and the diagonal / ragged-edge blocks (masked). Any T and S; E up to 128, padded to a power of two.
"""
from __future__ import annotations

import functools
import math
from types import MappingProxyType

import torch
import triton
import triton.language as tl

from .flash_attn import LOG2E, dot_precision, load_kv_tiles


@triton.jit
def _mask_scores(s, q_idx, k_idx, T, S, MASK, sm_t, sm_s, CAUSAL: tl.constexpr, CHECK_S: tl.constexpr,
                 HAS_MASK: tl.constexpr):
    """Scores s (either orientation) at query indices q_idx and key indices k_idx (each broadcastable to s):
    -inf where the key is invisible (causal, past S, or masked out)."""
    if CAUSAL:
        s = tl.where(k_idx <= q_idx, s, float("-inf"))
    if CHECK_S:
        s = tl.where(k_idx < S, s, float("-inf"))
    if HAS_MASK:
        vis = tl.load(MASK + q_idx * sm_t + k_idx * sm_s, mask=(q_idx < T) & (k_idx < S), other=0)
        s = tl.where(vis != 0, s, float("-inf"))
    return s


@triton.jit
def _key_range(m0, S, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """For the query block m0 .. m0 + BLOCK_M: keys [0, full_end) need no mask (whole blocks every row sees: under
    the causal mask, those below m0), keys [full_end, key_end) are the masked diagonal / ragged blocks."""
    if CAUSAL:
        return (tl.minimum(m0, S) // BLOCK_N) * BLOCK_N, tl.minimum(m0 + BLOCK_M, S)
    return (S // BLOCK_N) * BLOCK_N, S


@triton.jit
def _fwd_block(acc, m_i, l_i, q, Kb, Vb, MASKb, start, offs_m, offs_n, offs_e, e_ok, T, S, sk_s, sv_s, sm_t, sm_s,
               qk_scale, MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, EVEN_E: tl.constexpr,
               DOT_PRECISION: tl.constexpr):
    k, v = load_kv_tiles(Kb, Vb, start, offs_n, offs_e, e_ok, S, sk_s, sv_s, MASKED, EVEN_E)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [M, E] @ [E, N] -> [M, N]
    s = _mask_scores(s, offs_m[:, None], (start + offs_n)[None, :], T, S, MASKb, sm_t, sm_s, MASKED and CAUSAL,
                     MASKED, HAS_MASK)
    m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
    m_use = m_new
    if HAS_MASK:  # a row may have seen no key yet: keep -inf - -inf out of the exponents (p and alpha are 0)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s * qk_scale - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)  # += [M, N] @ [N, E]
    return acc, m_new, l_i


@triton.jit
def _fwd_kernel(Q, K, V, MASK, O, LSE, sq_b, sq_t, sq_h, sk_b, sk_s, sk_k, sv_b, sv_s, sv_k, so_b, so_t, so_h,
                sm_b, sm_t, sm_s, T, S, H, G, n_mblocks, qk_scale, E: tl.constexpr, CAUSAL: tl.constexpr,
                HAS_MASK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr,
                DOT_PRECISION: tl.constexpr):
    bh = tl.program_id(0)  # heads fastest, query blocks last-first: the causal launch runs longest-first
    b = (bh // H).to(tl.int64)
    h = bh % H
    m0 = (n_mblocks - 1 - tl.program_id(1)) * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_e = tl.arange(0, BLOCK_E)
    EVEN_E: tl.constexpr = BLOCK_E == E
    e_ok = offs_e < E
    row_ok = offs_m < T
    q = tl.load(Q + b * sq_b + h * sq_h + offs_m[:, None] * sq_t + offs_e[None, :],
                mask=row_ok[:, None] & e_ok[None, :], other=0.0)  # [M, E]
    Kb = K + b * sk_b + (h // G) * sk_k
    Vb = V + b * sv_b + (h // G) * sv_k
    MASKb = MASK + b * sm_b
    full_end, key_end = _key_range(m0, S, CAUSAL, BLOCK_M, BLOCK_N)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_E], tl.float32)
    for start in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _fwd_block(acc, m_i, l_i, q, Kb, Vb, MASKb, start, offs_m, offs_n, offs_e, e_ok, T, S,
                                   sk_s, sv_s, sm_t, sm_s, qk_scale, False, CAUSAL, HAS_MASK, EVEN_E, DOT_PRECISION)
    for start in range(full_end, key_end, BLOCK_N):
        acc, m_i, l_i = _fwd_block(acc, m_i, l_i, q, Kb, Vb, MASKb, start, offs_m, offs_n, offs_e, e_ok, T, S,
                                   sk_s, sv_s, sm_t, sm_s, qk_scale, True, CAUSAL, HAS_MASK, EVEN_E, DOT_PRECISION)
    if HAS_MASK:  # rows that saw no key: output 0, lse +inf (so the backward's P is 0 there)
        empty = l_i == 0.0
        l_safe = tl.where(empty, 1.0, l_i)
        out = acc / l_safe[:, None]
        lse = tl.where(empty, float("inf"), m_i + tl.log2(l_safe))
    else:
        out = acc / l_i[:, None]
        lse = m_i + tl.log2(l_i)
    tl.store(O + b * so_b + h * so_h + offs_m[:, None] * so_t + offs_e[None, :], out.to(O.dtype.element_ty),
             mask=row_ok[:, None] & e_ok[None, :])
    tl.store(LSE + bh.to(tl.int64) * T + offs_m, lse, mask=row_ok)


@triton.jit
def _dq_block(dq, q, do, lse, delta, Kb, Vb, MASKb, start, offs_m, offs_n, offs_e, e_ok, T, S, sk_s, sv_s, sm_t,
              sm_s, qk_scale, MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
              EVEN_E: tl.constexpr, DOT_PRECISION: tl.constexpr):
    k, v = load_kv_tiles(Kb, Vb, start, offs_n, offs_e, e_ok, S, sk_s, sv_s, MASKED, EVEN_E)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [M, E] @ [E, N] -> [M, N]
    s = _mask_scores(s, offs_m[:, None], (start + offs_n)[None, :], T, S, MASKb, sm_t, sm_s, MASKED and CAUSAL,
                     MASKED, HAS_MASK)
    p = tl.exp2(s * qk_scale - lse[:, None])  # [M, N], recomputed from the forward's lse
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)  # [M, E] @ [E, N] -> [M, N]
    ds = p * (dp - delta[:, None])
    return tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)  # += [M, N] @ [N, E]


@triton.jit
def _dq_kernel(Q, K, V, MASK, O, DO, LSE, DELTA, DQ, sq_b, sq_t, sq_h, sk_b, sk_s, sk_k, sv_b, sv_s, sv_k,
               so_b, so_t, so_h, sdo_b, sdo_t, sdo_h, sdq_b, sdq_t, sdq_h, sm_b, sm_t, sm_s, T, S, H, G, n_mblocks,
               qk_scale, sm_scale, E: tl.constexpr, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, DOT_PRECISION: tl.constexpr):
    bh = tl.program_id(0)
    b = (bh // H).to(tl.int64)
    h = bh % H
    m0 = (n_mblocks - 1 - tl.program_id(1)) * BLOCK_M
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_e = tl.arange(0, BLOCK_E)
    EVEN_E: tl.constexpr = BLOCK_E == E
    e_ok = offs_e < E
    q, do = load_kv_tiles(Q + b * sq_b + h * sq_h, DO + b * sdo_b + h * sdo_h, m0, offs_m, offs_e, e_ok, T, sq_t,
                          sdo_t, True, EVEN_E)  # [M, E] each, zero rows past T
    offs_m = m0 + offs_m
    row_ok = offs_m < T
    o = tl.load(O + b * so_b + h * so_h + offs_m[:, None] * so_t + offs_e[None, :],
                mask=row_ok[:, None] & e_ok[None, :], other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)  # Δ = rowsum(O · dO), [M]
    tl.store(DELTA + bh.to(tl.int64) * T + offs_m, delta, mask=row_ok)
    lse = tl.load(LSE + bh.to(tl.int64) * T + offs_m, mask=row_ok, other=float("inf"))
    Kb = K + b * sk_b + (h // G) * sk_k
    Vb = V + b * sv_b + (h // G) * sv_k
    MASKb = MASK + b * sm_b
    full_end, key_end = _key_range(m0, S, CAUSAL, BLOCK_M, BLOCK_N)
    dq = tl.zeros([BLOCK_M, BLOCK_E], tl.float32)
    for start in range(0, full_end, BLOCK_N):
        dq = _dq_block(dq, q, do, lse, delta, Kb, Vb, MASKb, start, offs_m, offs_n, offs_e, e_ok, T, S, sk_s, sv_s,
                       sm_t, sm_s, qk_scale, False, CAUSAL, HAS_MASK, EVEN_E, DOT_PRECISION)
    for start in range(full_end, key_end, BLOCK_N):
        dq = _dq_block(dq, q, do, lse, delta, Kb, Vb, MASKb, start, offs_m, offs_n, offs_e, e_ok, T, S, sk_s, sv_s,
                       sm_t, sm_s, qk_scale, True, CAUSAL, HAS_MASK, EVEN_E, DOT_PRECISION)
    tl.store(DQ + b * sdq_b + h * sdq_h + offs_m[:, None] * sdq_t + offs_e[None, :],
             (dq * sm_scale).to(DQ.dtype.element_ty), mask=row_ok[:, None] & e_ok[None, :])


@triton.jit
def _dkdv_block(dk, dv, k, v, Qb, DOb, LSEb, DELTAb, MASKb, m, offs_m, offs_n, offs_e, e_ok, T, S, sq_t, sdo_t,
                sm_t, sm_s, qk_scale, MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
                EVEN_T: tl.constexpr, EVEN_E: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # rows past T read as zeros with lse +inf: their P is 0 and they add nothing
    q, do = load_kv_tiles(Qb, DOb, m, offs_m, offs_e, e_ok, T, sq_t, sdo_t, not EVEN_T, EVEN_E)  # [M, E] each
    rows = m + offs_m
    if EVEN_T:
        lse = tl.load(LSEb + rows)
        delta = tl.load(DELTAb + rows)
    else:
        lse = tl.load(LSEb + rows, mask=rows < T, other=float("inf"))
        delta = tl.load(DELTAb + rows, mask=rows < T, other=0.0)
    st = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)  # [N, E] @ [E, M] -> [N, M], scores transposed
    st = _mask_scores(st, rows[None, :], offs_n[:, None], T, S, MASKb, sm_t, sm_s, MASKED and CAUSAL, False,
                      HAS_MASK)
    pt = tl.exp2(st * qk_scale - lse[None, :])  # Pᵀ [N, M]
    dv = tl.dot(pt.to(do.dtype), do, dv, input_precision=DOT_PRECISION)  # += [N, M] @ [M, E]
    dpt = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # [N, E] @ [E, M] -> dPᵀ [N, M]
    dst = pt * (dpt - delta[None, :])
    dk = tl.dot(dst.to(q.dtype), q, dk, input_precision=DOT_PRECISION)  # += [N, M] @ [M, E]
    return dk, dv


@triton.jit
def _dkdv_kernel(Q, K, V, MASK, DO, LSE, DELTA, DK, DV, sq_b, sq_t, sq_h, sk_b, sk_s, sk_k, sv_b, sv_s, sv_k,
                 sdo_b, sdo_t, sdo_h, sdk_p, sdk_b, sdk_s, sdk_k, sdv_p, sdv_b, sdv_s, sdv_k, sm_b, sm_t, sm_s, T, S,
                 NK, G, G_PART, qk_scale, sm_scale, E: tl.constexpr, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
                 EVEN_T: tl.constexpr, FLAT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_E: tl.constexpr, DOT_PRECISION: tl.constexpr):
    bk = tl.program_id(0)  # kv heads fastest, key blocks first-first: under the causal mask key block 0 has most rows
    b = (bk // NK).to(tl.int64)
    kh = bk % NK
    n0 = tl.program_id(1) * BLOCK_N
    part = tl.program_id(2)  # this program's share of the group: query heads g0 .. g0 + G_PART - 1
    g0 = part * G_PART
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_e = tl.arange(0, BLOCK_E)
    EVEN_E: tl.constexpr = BLOCK_E == E
    e_ok = offs_e < E
    k, v = load_kv_tiles(K + b * sk_b + kh * sk_k, V + b * sv_b + kh * sv_k, n0, offs_n, offs_e, e_ok, S, sk_s,
                         sv_s, True, EVEN_E)  # [N, E] each, read once for all the program's query heads
    offs_n = n0 + offs_n
    MASKb = MASK + b * sm_b
    m_lo = 0
    m_full = 0
    if CAUSAL:  # query blocks from the one holding row n0; from m_full on every row sees every key of the block
        m_lo = (n0 // BLOCK_M) * BLOCK_M
        m_full = tl.minimum(tl.cdiv(n0 + BLOCK_N, BLOCK_M) * BLOCK_M, T)
    dk = tl.zeros([BLOCK_N, BLOCK_E], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_E], tl.float32)
    if FLAT:  # (head, query block) pairs in one loop per region: the pipeline does not drain between heads
        if CAUSAL:
            n_diag = tl.maximum(tl.cdiv(m_full - m_lo, BLOCK_M), 0)
            for i in range(0, G_PART * n_diag):
                h = kh * G + g0 + i // n_diag
                bh = (b * NK * G + h) * T  # [B, H, T] row of (b, h)
                dk, dv = _dkdv_block(dk, dv, k, v, Q + b * sq_b + h * sq_h, DO + b * sdo_b + h * sdo_h, LSE + bh,
                                     DELTA + bh, MASKb, m_lo + (i % n_diag) * BLOCK_M, offs_m, offs_n, offs_e, e_ok,
                                     T, S, sq_t, sdo_t, sm_t, sm_s, qk_scale, True, CAUSAL, HAS_MASK, False, EVEN_E,
                                     DOT_PRECISION)
        n_full = tl.cdiv(T - m_full, BLOCK_M)
        for i in range(0, G_PART * n_full):
            h = kh * G + g0 + i // n_full
            bh = (b * NK * G + h) * T
            dk, dv = _dkdv_block(dk, dv, k, v, Q + b * sq_b + h * sq_h, DO + b * sdo_b + h * sdo_h, LSE + bh,
                                 DELTA + bh, MASKb, m_full + (i % n_full) * BLOCK_M, offs_m, offs_n, offs_e, e_ok, T,
                                 S, sq_t, sdo_t, sm_t, sm_s, qk_scale, False, CAUSAL, HAS_MASK, EVEN_T, EVEN_E,
                                 DOT_PRECISION)
    else:  # one loop per head and region (faster on long sequences: no index arithmetic per block)
        for g in range(g0, g0 + G_PART):
            h = kh * G + g
            Qb = Q + b * sq_b + h * sq_h
            DOb = DO + b * sdo_b + h * sdo_h
            LSEb = LSE + (b * NK * G + h) * T  # [B, H, T] row of (b, h)
            DELTAb = DELTA + (b * NK * G + h) * T
            for m in range(m_lo, m_full, BLOCK_M):
                dk, dv = _dkdv_block(dk, dv, k, v, Qb, DOb, LSEb, DELTAb, MASKb, m, offs_m, offs_n, offs_e, e_ok, T,
                                     S, sq_t, sdo_t, sm_t, sm_s, qk_scale, True, CAUSAL, HAS_MASK, False, EVEN_E,
                                     DOT_PRECISION)
            m_even = m_full + ((T - m_full) // BLOCK_M) * BLOCK_M
            for m in range(m_full, m_even, BLOCK_M):
                dk, dv = _dkdv_block(dk, dv, k, v, Qb, DOb, LSEb, DELTAb, MASKb, m, offs_m, offs_n, offs_e, e_ok, T,
                                     S, sq_t, sdo_t, sm_t, sm_s, qk_scale, False, CAUSAL, HAS_MASK, True, EVEN_E,
                                     DOT_PRECISION)
            for m in range(m_even, T, BLOCK_M):  # the ragged last query block
                dk, dv = _dkdv_block(dk, dv, k, v, Qb, DOb, LSEb, DELTAb, MASKb, m, offs_m, offs_n, offs_e, e_ok, T,
                                     S, sq_t, sdo_t, sm_t, sm_s, qk_scale, False, CAUSAL, HAS_MASK, False, EVEN_E,
                                     DOT_PRECISION)
    n_ok = (offs_n < S)[:, None] & e_ok[None, :]
    tl.store(DK + part * sdk_p + b * sdk_b + kh * sdk_k + offs_n[:, None] * sdk_s + offs_e[None, :],
             (dk * sm_scale).to(DK.dtype.element_ty), mask=n_ok)
    tl.store(DV + part * sdv_p + b * sdv_b + kh * sdv_k + offs_n[:, None] * sdv_s + offs_e[None, :],
             dv.to(DV.dtype.element_ty), mask=n_ok)


def _frozen(configs: dict) -> MappingProxyType:
    return MappingProxyType({part: MappingProxyType(dict(c)) for part, c in configs.items()})


def _small(n: int, cap: int) -> int:
    return max(16, min(cap, triton.next_power_of_2(n)))


@functools.lru_cache(maxsize=256)  # called every launch: the rules below cost tens of µs of host time a call
def default_configs(B: int, T: int, S: int, K: int, H: int, E: int, dtype: torch.dtype, on_gpu: bool):
    """Tile sizes {"fwd", "dq", "dkdv"} -> (BLOCK_M, BLOCK_N, num_warps, num_stages[, SPLIT]), read-only mappings
    shared by every call of the shape (the launchers copy them): the fastest of a sweep on an H100 (bf16, causal,
    8 kv heads, B=1; the record is cited in docs/performance.md, Training).
    The dK/dV pass has only B·K·S/BLOCK_N programs; where that is a fraction of a wave (S=2048: 256) E=64 splits
    each group of query heads over 2 programs (0.131 ms against 0.153 unsplit); E=128 did not gain from it.
    fp32 takes small tiles to stay inside shared memory."""
    if not on_gpu:  # the interpreter: small tiles are fastest
        m, n = _small(T, 32), _small(S, 32)
        c = dict(BLOCK_M=m, BLOCK_N=n, num_warps=4, num_stages=1)
        return _frozen({"fwd": c, "dq": c, "dkdv": c})
    if dtype == torch.float32:
        c = dict(BLOCK_M=_small(T, 32), BLOCK_N=_small(S, 32), num_warps=4, num_stages=2)
        return _frozen({"fwd": c, "dq": c, "dkdv": c})
    few_programs = B * K * triton.cdiv(S, 64) <= 512
    fwd = dict(BLOCK_M=_small(T, 64), BLOCK_N=_small(S, 64), num_warps=4, num_stages=3)
    if E <= 64:
        dkdv = dict(BLOCK_M=_small(T, 64), BLOCK_N=_small(S, 64), num_warps=4, num_stages=3)
        if few_programs and (H // K) % 2 == 0:
            dkdv["SPLIT"] = 2
        elif not few_programs:
            dkdv = dict(BLOCK_M=_small(T, 32), BLOCK_N=_small(S, 128), num_warps=4, num_stages=3)
        return _frozen({"fwd": fwd, "dq": dict(fwd), "dkdv": dkdv})
    dkdv = (dict(BLOCK_M=_small(T, 32), BLOCK_N=_small(S, 64), num_warps=4, num_stages=4) if few_programs else
            dict(BLOCK_M=_small(T, 64), BLOCK_N=_small(S, 128), num_warps=8, num_stages=3))
    return _frozen({"fwd": fwd, "dq": dict(BLOCK_M=_small(T, 128), BLOCK_N=_small(S, 64), num_warps=8, num_stages=3),
                    "dkdv": dkdv})


def _check(q, k, v, mask):
    B, T, H, E = q.shape
    _, S, NK, _ = k.shape
    assert k.shape == v.shape == (B, S, NK, E) and H % NK == 0 and E <= 128, (q.shape, k.shape, v.shape)
    assert mask is None or (mask.dtype == torch.bool and mask.shape == (B, T, S)), "mask: [B, T, S] bool"
    assert all(x.stride(3) == 1 for x in (q, k, v)), "head rows must be contiguous"


def _setup(q, k, mask, config: dict | None, part: str):
    """What every launcher needs: (B, T, H, E, S, K), a copy of the tile config of `part` (the defaults unless
    given), the mask as bytes with its strides (a placeholder and zeros when there is none: HAS_MASK is then
    False), and the constexprs all three kernels share."""
    B, T, H, E = q.shape
    S, NK = k.shape[1], k.shape[2]
    cfg = dict(config or default_configs(B, T, S, NK, H, E, q.dtype, q.is_cuda)[part])
    m = q if mask is None else mask.view(torch.uint8)
    strides = (0, 0, 0) if mask is None else tuple(m.stride())
    consts = dict(E=E, HAS_MASK=mask is not None, BLOCK_E=max(16, triton.next_power_of_2(E)),
                  DOT_PRECISION=dot_precision(q.dtype))
    return (B, T, H, E, S, NK), cfg, m, strides, consts


def flash_attn_train_fwd(q, k, v, causal: bool = True, mask=None, config: dict | None = None):
    """q [B, T, H, E], k/v [B, S, K, E], mask [B, T, S] bool or None -> (o [B, T, H, E] contiguous in q's dtype,
    lse [B, H, T] fp32, log2 domain, +inf for rows that see no key). `config` overrides the tile sizes."""
    _check(q, k, v, mask)
    (B, T, H, E, S, NK), cfg, mk, ms, consts = _setup(q, k, mask, config, "fwd")
    o = torch.empty((B, T, H, E), dtype=q.dtype, device=q.device)  # contiguous, whatever q's strides
    lse = torch.empty((B, H, T), dtype=torch.float32, device=q.device)
    n_mblocks = triton.cdiv(T, cfg["BLOCK_M"])
    _fwd_kernel[(B * H, n_mblocks)](q, k, v, mk, o, lse, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
                                    *o.stride()[:3], *ms, T, S, H, H // NK, n_mblocks, LOG2E / math.sqrt(E),
                                    CAUSAL=causal, **consts, **cfg)
    return o, lse


def flash_attn_dq(q, k, v, o, lse, do, causal, mask, config=None):
    """The dQ pass: -> (dq [B, T, H, E] in q's dtype, Δ [B, H, T] fp32) (Δ is the dK/dV pass's input)."""
    (B, T, H, E, S, NK), cfg, mk, ms, consts = _setup(q, k, mask, config, "dq")
    dq = torch.empty_like(q)
    delta = torch.empty((B, H, T), dtype=torch.float32, device=q.device)
    n_mblocks = triton.cdiv(T, cfg["BLOCK_M"])
    _dq_kernel[(B * H, n_mblocks)](q, k, v, mk, o, do, lse, delta, dq, *q.stride()[:3], *k.stride()[:3],
                                   *v.stride()[:3], *o.stride()[:3], *do.stride()[:3], *dq.stride()[:3], *ms, T, S,
                                   H, H // NK, n_mblocks, LOG2E / math.sqrt(E), 1.0 / math.sqrt(E), CAUSAL=causal,
                                   **consts, **cfg)
    return dq, delta


def flash_attn_dkdv(q, k, v, do, lse, delta, causal, mask, config=None):
    """The dK/dV pass (GQA-native: one program per key block of a kv head, looping over its query heads).
    config["SPLIT"] = P > 1 (P divides H/K) gives each (key block, kv head) P programs of H/K/P query heads each,
    for parallelism on short sequences: they write fp32 partial sums that are then added in a fixed order (still
    deterministic, and K/V are never repeated)."""
    (B, T, H, E, S, NK), cfg, mk, ms, consts = _setup(q, k, mask, config, "dkdv")
    split = cfg.pop("SPLIT", 1)
    assert (H // NK) % split == 0, "SPLIT must divide the group size H/K"
    if split == 1:
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        pk, pv = dk.unsqueeze(0), dv.unsqueeze(0)
    else:
        pk = torch.empty((split, *k.shape), dtype=torch.float32, device=k.device)  # [P, B, S, K, E]
        pv = torch.empty_like(pk)
    _dkdv_kernel[(B * NK, triton.cdiv(S, cfg["BLOCK_N"]), split)](
        q, k, v, mk, do, lse, delta, pk, pv, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3],
        *pk.stride()[:4], *pv.stride()[:4], *ms, T, S, NK, H // NK, H // NK // split, LOG2E / math.sqrt(E),
        1.0 / math.sqrt(E), CAUSAL=causal, EVEN_T=T % cfg["BLOCK_M"] == 0, FLAT=split > 1, **consts, **cfg)
    if split == 1:
        return dk, dv
    return pk.sum(0).to(k.dtype), pv.sum(0).to(v.dtype)


def flash_attn_bwd(q, k, v, o, lse, do, causal: bool = True, mask=None, configs: dict | None = None):
    """Gradients of flash_attn_train_fwd: (dq, dk, dv) in the inputs' dtypes and shapes, from the saved o and lse.
    `configs` overrides {"dq": ..., "dkdv": ...} tile sizes."""
    _check(q, k, v, mask)
    do = do if do.stride(3) == 1 else do.contiguous()
    configs = configs or default_configs(q.shape[0], q.shape[1], k.shape[1], k.shape[2], q.shape[2], q.shape[3],
                                         q.dtype, q.is_cuda)
    dq, delta = flash_attn_dq(q, k, v, o, lse, do, causal, mask, configs["dq"])
    dk, dv = flash_attn_dkdv(q, k, v, do, lse, delta, causal, mask, configs["dkdv"])
    return dq, dk, dv
