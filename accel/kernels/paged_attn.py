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
launch shape serves every length below it (CUDA graphs); a split past a sequence's length does nothing, and the
combination reads the ⌈len / split_len⌉ splits that hold positions (in invariant mode the same bits as adding the
empty ones' exact zeros). A sequence of length 0 (a padding row) gives zeros.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .flash_attn import LOG2E, dot_precision


@triton.jit
def _paged_split_kernel(Q, CK, CV, TABLES, LENS, ACC, M, L, O, COUNT, sq_b, sq_h, sk_k, sk_s, sv_k, sv_s, st_b,
                        so_b, so_h, E, G, H, NK, split_len, n_splits, qk_scale, BLOCK_SIZE: tl.constexpr,
                        BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr,
                        DOT_PRECISION: tl.constexpr, FUSED: tl.constexpr, TILE_BLOCKS: tl.constexpr,
                        PREFETCH: tl.constexpr):
    b = tl.program_id(0)
    kh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(LENS + b)
    start = split * split_len
    offs_g = tl.arange(0, BLOCK_G)
    g_ok = offs_g < G
    heads = kh * G + offs_g  # the query heads that read kv head kh
    offs_e = tl.arange(0, BLOCK_E)
    e_ok = offs_e < E
    out_mask = g_ok[:, None] & e_ok[None, :]
    if start < ctx:  # a split past the sequence's length does nothing: the combination reads the live ones only
        end = tl.minimum(start + split_len, ctx)
        offs_n = tl.arange(0, BLOCK_N)
        q = tl.load(Q + b * sq_b + heads[:, None] * sq_h + offs_e[None, :], mask=out_mask,
                    other=0.0)  # [G, E], padded to BLOCK_G >= 16 rows for tl.dot
        CK = CK + kh * sk_k
        CV = CV + kh * sv_k
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_E], tl.float32)
        if PREFETCH:  # the next tile's K/V loads issued before this tile's math
            k, v, ok = _tile(CK, CV, TABLES, b, st_b, sk_s, sv_s, start, end, offs_n, offs_e, e_ok, BLOCK_SIZE,
                             BLOCK_N, TILE_BLOCKS)
            for n0 in range(start, end, BLOCK_N):
                k_next, v_next, ok_next = _tile(CK, CV, TABLES, b, st_b, sk_s, sv_s, n0 + BLOCK_N, end, offs_n,
                                                offs_e, e_ok, BLOCK_SIZE, BLOCK_N, TILE_BLOCKS)
                m_i, l_i, acc = _attend(q, k, v, ok, m_i, l_i, acc, qk_scale, DOT_PRECISION)
                k, v, ok = k_next, v_next, ok_next
        else:
            for n0 in range(start, end, BLOCK_N):
                k, v, ok = _tile(CK, CV, TABLES, b, st_b, sk_s, sv_s, n0, end, offs_n, offs_e, e_ok, BLOCK_SIZE,
                                 BLOCK_N, TILE_BLOCKS)
                m_i, l_i, acc = _attend(q, k, v, ok, m_i, l_i, acc, qk_scale, DOT_PRECISION)
        row = (b * H + heads) * n_splits + split  # partials laid out [B, H, splits, (E)]
        if FUSED:
            n_live = tl.cdiv(ctx, split_len)
            if n_live == 1:  # the whole sequence in this split: what the combination would give, acc / l
                tl.store(O + b * so_b + heads[:, None] * so_h + offs_e[None, :],
                         (acc / l_i[:, None]).to(O.dtype.element_ty), mask=out_mask)
            else:
                _store_partials(ACC, M, L, row, m_i, l_i, acc, offs_e, E, g_ok, out_mask)
                tl.debug_barrier()  # every thread's partials stored before the count says so
                done = tl.atomic_add(COUNT + b * NK + kh, 1, sem="acq_rel", scope="gpu")
                if done == n_live - 1:  # the group's last split to finish combines them all, in split order
                    tl.atomic_xchg(COUNT + b * NK + kh, 0, sem="relaxed", scope="gpu")  # zero for the next launch
                    o = _combine_group(ACC, M, L, (b * H + heads) * n_splits, n_live, offs_e, E, g_ok, out_mask,
                                       BLOCK_G, BLOCK_E)
                    tl.store(O + b * so_b + heads[:, None] * so_h + offs_e[None, :], o.to(O.dtype.element_ty),
                             mask=out_mask)
        else:
            _store_partials(ACC, M, L, row, m_i, l_i, acc, offs_e, E, g_ok, out_mask)
    if FUSED:
        if ctx == 0:
            if split == 0:  # a padding row: zeros
                tl.store(O + b * so_b + heads[:, None] * so_h + offs_e[None, :],
                         tl.zeros([BLOCK_G, BLOCK_E], tl.float32).to(O.dtype.element_ty), mask=out_mask)


@triton.jit
def _tile(CK, CV, TABLES, b, st_b, sk_s, sv_s, n0, end, offs_n, offs_e, e_ok, BLOCK_SIZE: tl.constexpr,
          BLOCK_N: tl.constexpr, TILE_BLOCKS: tl.constexpr):
    """K and V of positions n0..n0+BLOCK_N-1 below `end`, through the block table -> (k [N, E], v [N, E], ok [N])."""
    pos = n0 + offs_n
    ok = pos < end
    if TILE_BLOCKS:  # the tile's BLOCK_N / BLOCK_SIZE block ids once, each block's rows contiguous
        blk = n0 // BLOCK_SIZE + tl.arange(0, BLOCK_N // BLOCK_SIZE)
        block = tl.load(TABLES + b * st_b + blk, mask=blk * BLOCK_SIZE < end, other=0)
        slot = tl.reshape(block.to(tl.int64)[:, None] * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)[None, :],
                          [BLOCK_N])  # [N/BS, BS] -> [N]
    else:
        block = tl.load(TABLES + b * st_b + pos // BLOCK_SIZE, mask=ok, other=0)  # constexpr: shifts, not divides
        slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE  # [N]
    kv_ok = ok[:, None] & e_ok[None, :]
    k = tl.load(CK + slot[:, None] * sk_s + offs_e[None, :], mask=kv_ok, other=0.0)  # [N, E]
    v = tl.load(CV + slot[:, None] * sv_s + offs_e[None, :], mask=kv_ok, other=0.0)
    return k, v, ok


@triton.jit
def _attend(q, k, v, ok, m_i, l_i, acc, qk_scale, DOT_PRECISION: tl.constexpr):
    """One tile into the running softmax (exp2 domain) -> (m, l, acc)."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [G, E] @ [E, N] -> [G, N]
    s = tl.where(ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)  # the tile's first key is inside: finite
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s * qk_scale - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)  # += [G, N] @ [N, E]
    return m_new, l_i, acc


@triton.jit
def _store_partials(ACC, M, L, row, m_i, l_i, acc, offs_e, E, g_ok, out_mask):
    tl.store(M + row, m_i, mask=g_ok)
    tl.store(L + row, l_i, mask=g_ok)
    tl.store(ACC + row[:, None] * E + offs_e[None, :], acc, mask=out_mask)


@triton.jit
def _combine_group(ACC, M, L, base, n_live, offs_e, E, g_ok, out_mask, BLOCK_G: tl.constexpr, BLOCK_E: tl.constexpr):
    """The partials at rows base + 0..n_live-1 of each head combined in split order -> [G, E] fp32 (loads past the
    L1: other programs wrote them)."""
    m_max = tl.full([BLOCK_G], float("-inf"), tl.float32)
    for s in range(0, n_live):
        m_max = tl.maximum(m_max, tl.load(M + base + s, mask=g_ok, other=0.0, cache_modifier=".cg"))
    denom = tl.zeros([BLOCK_G], tl.float32)
    num = tl.zeros([BLOCK_G, BLOCK_E], tl.float32)
    for s in range(0, n_live):
        w_s = tl.exp2(tl.load(M + base + s, mask=g_ok, other=0.0, cache_modifier=".cg") - m_max)
        denom += w_s * tl.load(L + base + s, mask=g_ok, other=0.0, cache_modifier=".cg")
        num += w_s[:, None] * tl.load(ACC + (base + s)[:, None] * E + offs_e[None, :], mask=out_mask, other=0.0,
                                      cache_modifier=".cg")
    return num / tl.where(denom == 0.0, 1.0, denom)[:, None]


@triton.jit
def _paged_combine_kernel(ACC, M, L, LENS, O, so_b, so_h, H, E, split_len, n_splits, BLOCK_S: tl.constexpr,
                          BLOCK_E: tl.constexpr, SEQUENTIAL: tl.constexpr):
    """Reads the splits that hold positions (those past the length wrote nothing). SEQUENTIAL: they are summed one
    after another (the same bits whatever the grid's width), instead of tl.sum's tree, whose shape follows the
    split count."""
    bh = tl.program_id(0)  # b·H + h
    b = bh // H
    h = bh % H
    n_live = tl.cdiv(tl.load(LENS + b), split_len)
    offs_s = tl.arange(0, BLOCK_S)
    s_ok = offs_s < n_live
    offs_e = tl.arange(0, BLOCK_E)
    e_ok = offs_e < E
    m = tl.load(M + bh * n_splits + offs_s, mask=s_ok, other=float("-inf"))  # [splits]
    m_max = tl.max(m, axis=0)  # exact in any order
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # a length-0 row: every weight 0, not NaN
    if SEQUENTIAL:
        denom = tl.zeros([1], tl.float32)
        num = tl.zeros([1, BLOCK_E], tl.float32)
        for s in range(0, n_live):
            w_s = tl.exp2(tl.load(M + bh * n_splits + s + tl.zeros([1], tl.int32)) - m_max)  # [1]
            denom += w_s * tl.load(L + bh * n_splits + s + tl.zeros([1], tl.int32))
            num += w_s[:, None] * tl.load(ACC + (bh * n_splits + s) * E + offs_e[None, :], mask=e_ok[None, :],
                                          other=0.0)
        out = tl.sum(num, axis=0) / tl.sum(tl.where(denom == 0.0, 1.0, denom), axis=0)  # sums of one element
    else:
        l = tl.load(L + bh * n_splits + offs_s, mask=s_ok, other=0.0)
        acc = tl.load(ACC + (bh * n_splits + offs_s)[:, None] * E + offs_e[None, :],
                      mask=s_ok[:, None] & e_ok[None, :], other=0.0)  # [splits, E]
        w = tl.exp2(m - m_max)
        denom = tl.sum(w * l, axis=0)
        out = tl.sum(w[:, None] * acc, axis=0) / tl.where(denom == 0.0, 1.0, denom)
    tl.store(O + b * so_b + h * so_h + offs_e, out.to(O.dtype.element_ty), mask=e_ok)


GPU_CONFIG = {"BLOCK_N": 64, "num_warps": 2, "num_stages": 2, "fused": False, "tile_blocks": False, "prefetch": False}
CPU_CONFIG = {"BLOCK_N": 16, "num_warps": 4, "num_stages": 2, "fused": False, "tile_blocks": False, "prefetch": False}
_COUNTERS: dict = {}  # device -> int32 arrival counts of the fused combination, zero between launches


def default_split_len(on_gpu: bool) -> int:
    """Positions per split: a fixed number (module docstring), a multiple of every BLOCK_N used here."""
    return 256 if on_gpu else 32


def _counters(device, n: int) -> torch.Tensor:
    """At least n zeroed counts on the device, allocated once (outside a capture: the graphs' warm-up runs first)
    and left zero by every launch."""
    c = _COUNTERS.get(device)
    if c is None or c.numel() < n:
        c = _COUNTERS[device] = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
    return c


def paged_decode_attention_fwd(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, tables: torch.Tensor,
                               lens: torch.Tensor, block_size: int, split_len: int | None = None,
                               out: torch.Tensor | None = None, config: dict | None = None,
                               invariant: bool = False) -> torch.Tensor:
    """q [B, H, E] (rotated; head rows contiguous), cache_k/cache_v [K, S, E], tables [B, W] int32 (physical block
    ids; entries past a sequence's length are never read), lens [B] int32 -> out [B, H, E] in q's dtype (out: rows
    with unit stride along E). config overrides GPU_CONFIG / CPU_CONFIG (tools/bench/sweeps/paged.py). invariant:
    the splits combined in order (the batch-invariant mode: the same bits whatever the tables' width)."""
    B, H, E = q.shape
    NK = cache_k.shape[0]
    assert H % NK == 0 and E <= 128 and q.stride(-1) == 1 and cache_k.stride(2) == 1 and cache_v.stride(2) == 1
    assert tables.shape[0] == B and lens.shape == (B,) and tables.stride(1) == 1
    on_gpu = q.is_cuda
    split_len = default_split_len(on_gpu) if split_len is None else split_len
    cfg = {**(GPU_CONFIG if on_gpu else CPU_CONFIG), **(config or {})}
    block_n = min(cfg.pop("BLOCK_N"), split_len)
    fused, tile_blocks, prefetch = cfg.pop("fused"), cfg.pop("tile_blocks"), cfg.pop("prefetch")
    tile_blocks = tile_blocks and block_n % block_size == 0
    assert split_len % block_n == 0 and block_n >= 16, "split_len must be a multiple of 16"
    n_splits = max(1, triton.cdiv(tables.shape[1] * block_size, split_len))
    G = H // NK
    acc = torch.empty((B, H, n_splits, E), dtype=torch.float32, device=q.device)
    m = torch.empty((B, H, n_splits), dtype=torch.float32, device=q.device)
    l = torch.empty((B, H, n_splits), dtype=torch.float32, device=q.device)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    assert out.shape == q.shape and out.stride(-1) == 1
    counts = _counters(q.device, B * NK) if fused else m
    block_e = max(16, triton.next_power_of_2(E))
    _paged_split_kernel[(B, NK, n_splits)](
        q, cache_k, cache_v, tables, lens, acc, m, l, out, counts, q.stride(0), q.stride(1), cache_k.stride(0),
        cache_k.stride(1), cache_v.stride(0), cache_v.stride(1), tables.stride(0), out.stride(0), out.stride(1), E, G,
        H, NK, split_len, n_splits, LOG2E / math.sqrt(E), BLOCK_SIZE=block_size,
        BLOCK_G=max(16, triton.next_power_of_2(G)), BLOCK_N=block_n, BLOCK_E=block_e,
        DOT_PRECISION=dot_precision(q.dtype), FUSED=fused, TILE_BLOCKS=tile_blocks, PREFETCH=prefetch, **cfg)
    if not fused:
        _paged_combine_kernel[(B * H,)](acc, m, l, lens, out, out.stride(0), out.stride(1), H, E, split_len,
                                        n_splits, BLOCK_S=triton.next_power_of_2(n_splits), BLOCK_E=block_e,
                                        SEQUENTIAL=invariant, num_warps=4)
    return out
