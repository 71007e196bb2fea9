"""Paged decode attention in Triton: one new token per sequence, B sequences of their own lengths, K/V in a block pool.

The cache is a pool of slots per kv head, cache_k/cache_v [K, S, E] (S = blocks × block_size); sequence b's position p
lives at slot `tables[b, p // block_size] * block_size + p % block_size`, and it sees positions 0..lens[b]-1 (its new
token's k/v already written). As in accel/kernels/decode_attn.py (flash-decoding), each sequence's keys are cut into
splits of `split_len` positions; program (b, kv head, split) computes, for all H/K query heads that read its kv head
(GQA-native: each K/V row read once for the whole group), the split's unnormalized partial output and its softmax
statistics (max m, sum l; exp2 domain). A second kernel combines a head's splits:
    out = Σ_s 2^(m_s − M) · acc_s / Σ_s 2^(m_s − M) · l_s,   M = max_s m_s.
Keys are gathered per row through the block table, so the kernel's tile (BLOCK_N keys) does not depend on the block
size. split_len is fixed, never derived from B or the grid: a sequence's reduction order depends on its own length only
(what a batch-invariant step needs). The grid covers `max_len` positions (the tables' width × block_size), so one
launch shape serves every length below it (CUDA graphs); splits past a sequence's length run an empty loop and record
m = −inf, l = 0, acc = 0, which the combination weighs as 0. A sequence of length 0 (a padding row) gives zeros.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .flash_attn import LOG2E, dot_precision


@triton.jit
def _paged_split_kernel(Q, CK, CV, TABLES, LENS, ACC, M, L, sq_b, sq_h, sk_k, sk_s, sv_k, sv_s, st_b, E, G, H,
                        split_len, n_splits, qk_scale, BLOCK_SIZE: tl.constexpr, BLOCK_G: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, DOT_PRECISION: tl.constexpr):
    b = tl.program_id(0)
    kh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(LENS + b)
    start = split * split_len
    end = tl.minimum(start + split_len, ctx)
    offs_g = tl.arange(0, BLOCK_G)
    g_ok = offs_g < G
    heads = kh * G + offs_g  # the query heads that read kv head kh
    offs_n = tl.arange(0, BLOCK_N)
    offs_e = tl.arange(0, BLOCK_E)
    e_ok = offs_e < E
    q = tl.load(Q + b * sq_b + heads[:, None] * sq_h + offs_e[None, :], mask=g_ok[:, None] & e_ok[None, :],
                other=0.0)  # [G, E], padded to BLOCK_G >= 16 rows for tl.dot
    CK = CK + kh * sk_k
    CV = CV + kh * sv_k
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_E], tl.float32)
    for n0 in range(start, end, BLOCK_N):  # empty past the sequence's length
        pos = n0 + offs_n
        ok = pos < end
        block = tl.load(TABLES + b * st_b + pos // BLOCK_SIZE, mask=ok, other=0)  # constexpr: shifts, not divides
        slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE  # [N]
        kv_ok = ok[:, None] & e_ok[None, :]
        k = tl.load(CK + slot[:, None] * sk_s + offs_e[None, :], mask=kv_ok, other=0.0)  # [N, E]
        v = tl.load(CV + slot[:, None] * sv_s + offs_e[None, :], mask=kv_ok, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [G, E] @ [E, N] -> [G, N]
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)  # the block's first key is inside: finite
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s * qk_scale - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)  # += [G, N] @ [N, E]
        m_i = m_new
    row = (b * H + heads) * n_splits + split  # partials laid out [B, H, splits, (E)]
    tl.store(M + row, m_i, mask=g_ok)
    tl.store(L + row, l_i, mask=g_ok)
    tl.store(ACC + row[:, None] * E + offs_e[None, :], acc, mask=g_ok[:, None] & e_ok[None, :])


@triton.jit
def _paged_combine_kernel(ACC, M, L, O, so_b, so_h, H, E, n_splits, BLOCK_S: tl.constexpr, BLOCK_E: tl.constexpr,
                          SEQUENTIAL: tl.constexpr):
    """SEQUENTIAL: the splits summed one after another (the same bits whatever the grid's width: splits past a
    sequence's length add exact zeros at the end), instead of tl.sum's tree, whose shape follows the split count."""
    bh = tl.program_id(0)  # b·H + h
    b = bh // H
    h = bh % H
    offs_s = tl.arange(0, BLOCK_S)
    s_ok = offs_s < n_splits
    offs_e = tl.arange(0, BLOCK_E)
    e_ok = offs_e < E
    m = tl.load(M + bh * n_splits + offs_s, mask=s_ok, other=float("-inf"))  # [splits]
    l = tl.load(L + bh * n_splits + offs_s, mask=s_ok, other=0.0)
    acc = tl.load(ACC + (bh * n_splits + offs_s)[:, None] * E + offs_e[None, :], mask=s_ok[:, None] & e_ok[None, :],
                  other=0.0)  # [splits, E]
    m_max = tl.max(m, axis=0)  # exact in any order
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # a length-0 row: every weight 0, not NaN
    if SEQUENTIAL:
        denom = tl.zeros([1], tl.float32)
        num = tl.zeros([1, BLOCK_E], tl.float32)
        for s in range(0, n_splits):
            w_s = tl.exp2(tl.load(M + bh * n_splits + s + tl.zeros([1], tl.int32)) - m_max)  # [1]
            denom += w_s * tl.load(L + bh * n_splits + s + tl.zeros([1], tl.int32))
            num += w_s[:, None] * tl.load(ACC + (bh * n_splits + s) * E + offs_e[None, :], mask=e_ok[None, :],
                                          other=0.0)
        out = tl.sum(num, axis=0) / tl.sum(tl.where(denom == 0.0, 1.0, denom), axis=0)  # sums of one element
    else:
        w = tl.exp2(m - m_max)
        denom = tl.sum(w * l, axis=0)
        out = tl.sum(w[:, None] * acc, axis=0) / tl.where(denom == 0.0, 1.0, denom)
    tl.store(O + b * so_b + h * so_h + offs_e, out.to(O.dtype.element_ty), mask=e_ok)


def default_split_len(on_gpu: bool) -> int:
    """Positions per split: a fixed number (module docstring), a multiple of every BLOCK_N used here."""
    return 256 if on_gpu else 32


def paged_decode_attention_fwd(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, tables: torch.Tensor,
                               lens: torch.Tensor, block_size: int, split_len: int | None = None,
                               out: torch.Tensor | None = None, config: dict | None = None,
                               invariant: bool = False) -> torch.Tensor:
    """q [B, H, E] (rotated; head rows contiguous), cache_k/cache_v [K, S, E], tables [B, W] int32 (physical block
    ids; entries past a sequence's length are never read), lens [B] int32 -> out [B, H, E] in q's dtype.
    config overrides BLOCK_N, num_warps, num_stages (`python3 -m tools.bench.sweeps.paged_launch`). invariant: the
    splits combined in order (the batch-invariant mode: the same bits whatever the tables' width)."""
    B, H, E = q.shape
    NK = cache_k.shape[0]
    assert H % NK == 0 and E <= 128 and q.stride(-1) == 1 and cache_k.stride(2) == 1 and cache_v.stride(2) == 1
    assert tables.shape[0] == B and lens.shape == (B,) and tables.stride(1) == 1
    on_gpu = q.is_cuda
    split_len = default_split_len(on_gpu) if split_len is None else split_len
    # GPU: 64-key tiles, 2 warps, 2 stages: the fastest of tools.bench.sweeps.paged_launch (1B shape, B 64-256)
    cfg = {"BLOCK_N": 64 if on_gpu else 16, "num_warps": 2 if on_gpu else 4, "num_stages": 2, **(config or {})}
    block_n = min(cfg.pop("BLOCK_N"), split_len)
    assert split_len % block_n == 0 and block_n >= 16, "split_len must be a multiple of 16"
    n_splits = max(1, triton.cdiv(tables.shape[1] * block_size, split_len))
    G = H // NK
    acc = torch.empty((B, H, n_splits, E), dtype=torch.float32, device=q.device)
    m = torch.empty((B, H, n_splits), dtype=torch.float32, device=q.device)
    l = torch.empty((B, H, n_splits), dtype=torch.float32, device=q.device)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    block_e = max(16, triton.next_power_of_2(E))
    _paged_split_kernel[(B, NK, n_splits)](
        q, cache_k, cache_v, tables, lens, acc, m, l, q.stride(0), q.stride(1), cache_k.stride(0), cache_k.stride(1),
        cache_v.stride(0), cache_v.stride(1), tables.stride(0), E, G, H, split_len, n_splits, LOG2E / math.sqrt(E),
        BLOCK_SIZE=block_size, BLOCK_G=max(16, triton.next_power_of_2(G)), BLOCK_N=block_n, BLOCK_E=block_e,
        DOT_PRECISION=dot_precision(q.dtype), **cfg)
    _paged_combine_kernel[(B * H,)](acc, m, l, out, out.stride(0), out.stride(1), H, E, n_splits,
                                    BLOCK_S=triton.next_power_of_2(n_splits), BLOCK_E=block_e, SEQUENTIAL=invariant,
                                    num_warps=4)
    return out
