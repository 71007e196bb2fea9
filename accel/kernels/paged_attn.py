"""Paged decode attention in Triton: one new token per sequence, B sequences of their own lengths, K/V in a block pool.

The cache is a pool of slots per kv head, cache_k/cache_v [K, S, E] (S = blocks × block_size); sequence b's position p
lives at slot `tables[b, p // block_size] * block_size + p % block_size`, and it sees positions 0..lens[b]-1 (its new
token's k/v already written). As in accel/kernels/decode_attn.py (flash-decoding), each sequence's keys are cut into
splits of `split_len` positions; program (b, kv head, split) computes, for all H/K query heads that read its kv head
(GQA-native: each K/V row read once for the whole group), the split's unnormalized partial output and its softmax
statistics (max m, sum l; exp2 domain). One launch does the whole attention: a sequence that fits one split is written
directly (acc / l); otherwise each split stores its partials and counts itself in with an atomic, and the group's last
split to arrive combines all of them, in split order:
    out = Σ_s 2^(m_s − M) · acc_s / Σ_s 2^(m_s − M) · l_s,   M = max_s m_s,
then sets the count back to zero for the next launch (a CUDA graph replays it). Which program combines depends on
timing; what it computes does not.
Where the block size is a multiple of the tile (BLOCK_N keys), a tile is one block's consecutive slots: one block id
a tile, a contiguous [BLOCK_N, E] load; else keys are gathered per row through the block table.
By default split_len is fixed, never derived from B or the grid, and the combination's order is the splits': a
sequence's reduction order depends on its own length only (what a batch-invariant step needs). The grid covers
`max_len` positions (the tables' width × block_size), so one launch shape serves every length below it (CUDA graphs);
a split past a sequence's length does nothing, and the combination reads the ⌈len / split_len⌉ splits that hold
positions. A sequence of length 0 (a padding row) gives zeros.
With `even` (the engine outside its batch-invariant mode) the grid has split_count(B, ...) splits a sequence and each
sequence is cut into that many equal ones (whole tiles), so the programs fill the GPU whatever B is and no split is
nearly empty (a 513-token sequence: 320 + 193 positions, not 512 + 1); a row's reduction order then depends on B.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .flash_attn import LOG2E, dot_precision


@triton.jit
def _paged_decode_kernel(Q, CK, CV, TABLES, LENS, ACC, M, L, O, COUNT, sq_b, sq_h, sk_k, sk_s, sv_k, sv_s, st_b,
                         so_b, so_h, E, G, H, NK, split_len, n_splits, qk_scale, BLOCK_SIZE: tl.constexpr,
                         BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr,
                         DOT_PRECISION: tl.constexpr, EVEN: tl.constexpr):
    b = tl.program_id(0)
    kh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(LENS + b)
    if EVEN:  # the sequence cut into n_splits splits of equal length, rounded up to whole tiles
        split_len = tl.maximum(tl.cdiv(tl.cdiv(ctx, n_splits), BLOCK_N), 1) * BLOCK_N
    start = split * split_len
    offs_g = tl.arange(0, BLOCK_G)
    g_ok = offs_g < G
    heads = kh * G + offs_g  # the query heads that read kv head kh
    offs_e = tl.arange(0, BLOCK_E)
    e_ok = offs_e < E
    out_mask = g_ok[:, None] & e_ok[None, :]
    out_ptrs = O + b * so_b + heads[:, None] * so_h + offs_e[None, :]
    if start < ctx:  # a split past the sequence's length does nothing
        end = tl.minimum(start + split_len, ctx)
        offs_n = tl.arange(0, BLOCK_N)
        q = tl.load(Q + b * sq_b + heads[:, None] * sq_h + offs_e[None, :], mask=out_mask,
                    other=0.0)  # [G, E], padded to BLOCK_G >= 16 rows for tl.dot
        CK = CK + kh * sk_k
        CV = CV + kh * sv_k
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_E], tl.float32)
        for n0 in range(start, end, BLOCK_N):
            pos = n0 + offs_n
            ok = pos < end
            if BLOCK_SIZE % BLOCK_N == 0:  # the tile inside one block (n0 a multiple of BLOCK_N): one id, one run
                block = tl.load(TABLES + b * st_b + n0 // BLOCK_SIZE).to(tl.int64)
                slot = block * BLOCK_SIZE + n0 % BLOCK_SIZE + offs_n  # [N], consecutive
            else:  # each row's block: constexpr block size, so shifts, not divides
                block = tl.load(TABLES + b * st_b + pos // BLOCK_SIZE, mask=ok, other=0)
                slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE  # [N]
            kv_ok = ok[:, None] & e_ok[None, :]
            k = tl.load(CK + slot[:, None] * sk_s + offs_e[None, :], mask=kv_ok, other=0.0)  # [N, E]
            v = tl.load(CV + slot[:, None] * sv_s + offs_e[None, :], mask=kv_ok, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [G, E] @ [E, N] -> [G, N]
            s = tl.where(ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)  # the tile's first key is inside: finite
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s * qk_scale - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)  # += [G, N] @ [N, E]
            m_i = m_new
        n_live = tl.cdiv(ctx, split_len)
        if n_live == 1:  # the whole sequence in this split: what the combination would give, acc / l
            tl.store(out_ptrs, (acc / l_i[:, None]).to(O.dtype.element_ty), mask=out_mask)
        else:
            base = (b * H + heads) * n_splits  # partials laid out [B, H, splits, (E)]
            tl.store(M + base + split, m_i, mask=g_ok)
            tl.store(L + base + split, l_i, mask=g_ok)
            tl.store(ACC + (base + split)[:, None] * E + offs_e[None, :], acc, mask=out_mask)
            tl.debug_barrier()  # every thread's partials stored before the count says so
            done = tl.atomic_add(COUNT + b * NK + kh, 1, sem="acq_rel", scope="gpu")
            if done == n_live - 1:  # the group's last split to finish combines them all, in split order
                tl.atomic_xchg(COUNT + b * NK + kh, 0, sem="relaxed", scope="gpu")  # zero for the next launch
                o = _combine(ACC, M, L, base, n_live, offs_e, E, g_ok, out_mask, BLOCK_G, BLOCK_E)
                tl.store(out_ptrs, o.to(O.dtype.element_ty), mask=out_mask)
    if ctx == 0:
        if split == 0:  # a padding row: zeros
            tl.store(out_ptrs, tl.zeros([BLOCK_G, BLOCK_E], tl.float32).to(O.dtype.element_ty), mask=out_mask)


@triton.jit
def _combine(ACC, M, L, base, n_live, offs_e, E, g_ok, out_mask, BLOCK_G: tl.constexpr, BLOCK_E: tl.constexpr):
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


# GPU: 64-key tiles, 2 warps: with 512-position splits the fastest at B 64 and 256 of tools/bench/sweeps/paged.py
GPU_CONFIG = {"BLOCK_N": 64, "num_warps": 2, "num_stages": 2}
CPU_CONFIG = {"BLOCK_N": 16, "num_warps": 4, "num_stages": 2}
SPLIT_PROGRAMS = 512  # split_count's target: (sequence, kv head, split) programs a launch (docs/performance.md)
_COUNTERS: dict = {}  # device -> int32 arrival counts of the combination, zero between launches


def default_split_len(on_gpu: bool) -> int:
    """Positions per split: a fixed number (module docstring), a multiple of every BLOCK_N used here."""
    return 512 if on_gpu else 32


def _counters(device, n: int) -> torch.Tensor:
    """At least n zeroed counts on the device, allocated once (outside a capture: the graphs' warm-up runs first)
    and left zero by every launch."""
    c = _COUNTERS.get(device)
    if c is None or c.numel() < n:
        c = _COUNTERS[device] = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
    return c


def split_count(batch: int, kv_heads: int, max_len: int, block_n: int) -> int:
    """Splits a sequence for the launches outside the batch-invariant mode (each sequence cut into this many
    equal ones): enough (b, kv head, split) programs to reach SPLIT_PROGRAMS, never a split under one tile."""
    want = triton.cdiv(SPLIT_PROGRAMS, batch * kv_heads)
    return max(1, min(want, triton.cdiv(max_len, block_n)))


def paged_decode_attention_fwd(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, tables: torch.Tensor,
                               lens: torch.Tensor, block_size: int, split_len: int | None = None,
                               out: torch.Tensor | None = None, config: dict | None = None,
                               even: bool = False) -> torch.Tensor:
    """q [B, H, E] (rotated; head rows contiguous), cache_k/cache_v [K, S, E], tables [B, W] int32 (physical block
    ids; entries past a sequence's length are never read), lens [B] int32 -> out [B, H, E] in q's dtype (out: rows
    with unit stride along E). config overrides GPU_CONFIG / CPU_CONFIG (tools/bench/sweeps/paged.py).
    even=False: splits of split_len positions (default_split_len), so the result's bits depend on each sequence's
    own q, K/V and length only (batch-invariant as it is). even=True: each sequence cut into split_count(...) equal
    splits, a number that depends on B (faster: no nearly empty last split, the grid sized to the SMs)."""
    B, H, E = q.shape
    NK = cache_k.shape[0]
    assert H % NK == 0 and E <= 128 and q.stride(-1) == 1 and cache_k.stride(2) == 1 and cache_v.stride(2) == 1
    assert tables.shape[0] == B and lens.shape == (B,) and tables.stride(1) == 1
    on_gpu = q.is_cuda
    split_len = default_split_len(on_gpu) if split_len is None else split_len
    cfg = {**(GPU_CONFIG if on_gpu else CPU_CONFIG), **(config or {})}
    block_n = min(cfg.pop("BLOCK_N"), split_len)
    assert split_len % block_n == 0 and block_n >= 16, "split_len must be a multiple of 16"
    max_len = tables.shape[1] * block_size
    n_splits = split_count(B, NK, max_len, block_n) if even else max(1, triton.cdiv(max_len, split_len))
    G = H // NK
    acc = torch.empty((B, H, n_splits, E), dtype=torch.float32, device=q.device)
    m = torch.empty((B, H, n_splits), dtype=torch.float32, device=q.device)
    l = torch.empty((B, H, n_splits), dtype=torch.float32, device=q.device)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    assert out.shape == q.shape and out.stride(-1) == 1
    _paged_decode_kernel[(B, NK, n_splits)](
        q, cache_k, cache_v, tables, lens, acc, m, l, out, _counters(q.device, B * NK), q.stride(0), q.stride(1),
        cache_k.stride(0), cache_k.stride(1), cache_v.stride(0), cache_v.stride(1), tables.stride(0), out.stride(0),
        out.stride(1), E, G, H, NK, split_len, n_splits, LOG2E / math.sqrt(E), BLOCK_SIZE=block_size,
        BLOCK_G=max(16, triton.next_power_of_2(G)), BLOCK_N=block_n, BLOCK_E=max(16, triton.next_power_of_2(E)),
        DOT_PRECISION=dot_precision(q.dtype), EVEN=even, **cfg)
    return out
