"""The decode step's attention input in one launch: RMSNorm -> fused QKV GEMV -> RoPE -> KV-cache write.

For the one new token, x [D] (the residual stream) becomes
    q_rot [H, E]             = rope(q)            (returned),
    cache_k[:, pos] [K, E]   = rope(k),   cache_v[:, pos] [K, E] = v,
where [q | k | v] = qkv_weight @ rms_norm(x): what `gemv_fwd(norm_weight=...)` followed by `rope_kv_write_fwd`
computes, with the same roundings (the GEMV result rounded to the dtype, rotated in fp32, rounded again), in one
kernel instead of two. RoPE pairs column c of a head with column c + E/2 (HF's rotate_half), so a program owns
HALF_N columns of the first half of one head AND the HALF_N matching columns of the second half: both halves'
rows of the weight, [HALF_N, K] each, all loaded at once (no K loop; K = 3072 is one masked 4096-wide tile:
three 1024-wide ones took half the registers but were slower).
Rows are whole (one program does the full K), so the pair is complete in the program and no reduce is needed.
The streaming variant (_qkv_rope_stream_kernel; QkvConfig.stages > 0) walks K in tiles through shared memory
instead, like gemv's "stream" kind: faster at the 3B's shape (docs/performance.md).

Why: at batch 1 a separate rope/KV-write kernel and its launch gap cost a third of the qkv GEMV's time, and
reading the position and cos/sin rows in the kernel also drops the decode step's two index_select launches.
On the GPU the kernel lets its dependents launch at once (PDL): the decode attention after it, PDL-launched over
long caches, starts early.
"""
from __future__ import annotations

from typing import Mapping

import torch
import triton
import triton.language as tl

from . import tuning
from .common import gdc_launch_dependents, pdl_available, prologue_fx, rms_rstd, row_tile, sm_count
from .rope import rotate_half
from .tuning import QkvConfig


@triton.jit
def rope_store(a1, a2, head, cols, col_ok, pos, COS, SIN, QO, CK, CV, s_cos, s_sin, sc_k, sc_s, scv_k, scv_s, H, NKV,
               E: tl.constexpr):
    """Round the GEMV rows (as unfused), rotate q/k pairs (c, c + E/2) in fp32, store q, or k/v into the cache."""
    half: tl.constexpr = E // 2
    dt = QO.dtype.element_ty
    a1 = a1.to(dt).to(tl.float32)
    a2 = a2.to(dt).to(tl.float32)
    if head < H + NKV:  # q and k rotate; v is copied
        c = tl.load(COS + pos * s_cos + cols, mask=col_ok, other=1.0)
        s = tl.load(SIN + pos * s_sin + cols, mask=col_ok, other=0.0)
        y1, y2 = rotate_half(a1, a2, c, s)
    else:
        y1 = a1
        y2 = a2
    if head < H:
        dst = QO + head * E + cols
    elif head < H + NKV:
        dst = CK + (head - H) * sc_k + pos * sc_s + cols
    else:
        dst = CV + (head - H - NKV) * scv_k + pos * scv_s + cols
    tl.store(dst, y1.to(dt), mask=col_ok)
    tl.store(dst + half, y2.to(dt), mask=col_ok)


@triton.jit
def _qkv_rope_kernel(W, X, NW, COS, SIN, POS, QO, CK, CV, K, stride_w, eps, s_cos, s_sin, sc_k, sc_s, scv_k, scv_s,
                     H, NKV, E: tl.constexpr, HALF_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                     PDL: tl.constexpr = False):
    if PDL:
        gdc_launch_dependents()  # the decode attention after us may start its prologue (it waits for our writes)
    half: tl.constexpr = E // 2
    per_head: tl.constexpr = (half + HALF_N - 1) // HALF_N
    b = tl.program_id(0)
    head = b // per_head  # over the H + 2·NKV heads of the fused output: q heads, then k, then v
    cols = (b % per_head) * HALF_N + tl.arange(0, HALF_N)  # [HN] columns of the head's first half
    col_ok = cols < half  # all true at E = 64/128; a tail only for head sizes like 24 (tests)
    offs_k = tl.arange(0, BLOCK_K)
    rows1 = (head * E + tl.minimum(cols, half - 1)).to(tl.int64)  # tail columns re-read a row; stores masked
    rows2 = rows1 + half  # the partner rows, E/2 further
    w1 = row_tile(W, rows1, stride_w, 0, offs_k, K, EVEN_K)  # [HN, BK], BK = next_power_of_2(K)
    w2 = row_tile(W, rows2, stride_w, 0, offs_k, K, EVEN_K)
    rstd = rms_rstd(X, K, eps, BLOCK_K)
    fx = prologue_fx(X, NW, 0, offs_k, K, rstd, 1, EVEN_K)  # [BK] rms_norm(x), HF's roundings
    a1 = tl.sum(w1.to(tl.float32) * fx[None, :], axis=1)  # [HN]
    a2 = tl.sum(w2.to(tl.float32) * fx[None, :], axis=1)
    pos = tl.load(POS).to(tl.int64)
    rope_store(a1, a2, head, cols, col_ok, pos, COS, SIN, QO, CK, CV, s_cos, s_sin, sc_k, sc_s, scv_k, scv_s, H, NKV,
               E)


@triton.jit
def _qkv_rope_stream_kernel(W, X, NW, COS, SIN, POS, QO, CK, CV, K, stride_w, eps, s_cos, s_sin, sc_k, sc_s, scv_k,
                            scv_s, H, NKV, n_blocks, E: tl.constexpr, HALF_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            K_POW2: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr = False):
    """The same work as _qkv_rope_kernel, persistent like gemv._gemv_stream_kernel: program p owns pair blocks
    p, p + P, ... and streams their [HALF_N, BLOCK_K] tile pairs through shared memory (Triton's cp.async
    pipeline, STAGES deep) instead of holding whole rows in registers. K % BLOCK_K == 0."""
    if PDL:
        gdc_launch_dependents()
    half: tl.constexpr = E // 2
    per_head: tl.constexpr = (half + HALF_N - 1) // HALF_N
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n_k = K // BLOCK_K
    total = tl.cdiv(n_blocks - pid, nprog) * n_k
    rstd = rms_rstd(X, K, eps, K_POW2)
    pos = tl.load(POS).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    acc1 = tl.zeros([HALF_N, BLOCK_K], dtype=tl.float32)
    acc2 = tl.zeros([HALF_N, BLOCK_K], dtype=tl.float32)
    for i in tl.range(0, total, num_stages=STAGES):
        b = pid + (i // n_k) * nprog
        k0 = (i % n_k) * BLOCK_K
        head = b // per_head
        cols = (b % per_head) * HALF_N + tl.arange(0, HALF_N)
        rows1 = (head * E + tl.minimum(cols, half - 1)).to(tl.int64)
        w1 = tl.load(W + rows1[:, None] * stride_w + k0 + offs_k[None, :])  # [HN, BK]
        w2 = tl.load(W + (rows1 + half)[:, None] * stride_w + k0 + offs_k[None, :])
        fx = prologue_fx(X, NW, k0, offs_k, K, rstd, 1, True)[None, :]
        acc1 += w1.to(tl.float32) * fx
        acc2 += w2.to(tl.float32) * fx
        if k0 + BLOCK_K == K:
            rope_store(tl.sum(acc1, axis=1), tl.sum(acc2, axis=1), head, cols, cols < half, pos, COS, SIN, QO, CK,
                       CV, s_cos, s_sin, sc_k, sc_s, scv_k, scv_s, H, NKV, E)
            acc1 = tl.zeros([HALF_N, BLOCK_K], dtype=tl.float32)
            acc2 = tl.zeros([HALF_N, BLOCK_K], dtype=tl.float32)


def qkv_config(N: int, K: int, E: int, sms: int,
               table: Mapping[tuple[int, int], QkvConfig] = tuning.QKV_ROPE) -> QkvConfig:
    """`table`'s row on a GPU, else: on the GPU ~8 rows (16-32 KB of weights) a program, like the split GEMV's
    best 1B config; on the CPU (TRITON_INTERPRET) one program a head, its cost being per program and per op."""
    if sms and (N, K) in table:
        return table[(N, K)]
    if sms == 0:
        return QkvConfig(triton.next_power_of_2(E // 2), 4)
    return QkvConfig(min(E // 2, 4 if K <= 2048 else 2), 8)


def qkv_rope_fwd(weight: torch.Tensor, x: torch.Tensor, norm_weight: torch.Tensor, eps: float, cos: torch.Tensor,
                 sin: torch.Tensor, position: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
                 q_out: torch.Tensor | None = None, config: QkvConfig | tuple | None = None,
                 table: Mapping[tuple[int, int], QkvConfig] = tuning.QKV_ROPE) -> torch.Tensor:
    """weight [(H+2K)·E, D] (rows q, k, v), x [1, D], norm_weight [D], cos/sin [S, E/2] fp32 (the whole tables:
    row `position` is read on the device), position [1] int, cache_k/cache_v [K, S, E] -> q_rot [1, H, E];
    rope(k) and v are written to slot `position` of the caches."""
    NKV, S, E = cache_k.shape
    N, D = weight.shape
    H = N // E - 2 * NKV
    assert H > 0 and N == (H + 2 * NKV) * E and E % 2 == 0, "weight rows must be (H + 2K)·E"
    assert weight.stride(1) == 1 and x.numel() == D and x.reshape(-1).stride(0) == 1
    assert norm_weight.shape == (D,) and norm_weight.stride(0) == 1
    assert cache_v.shape == cache_k.shape and cache_k.stride(2) == 1 and cache_v.stride(2) == 1
    assert cos.shape == (S, E // 2) and cos.stride(1) == 1 and sin.stride(1) == 1 and position.numel() == 1
    q_out = torch.empty((1, H, E), dtype=x.dtype, device=x.device) if q_out is None else q_out
    assert q_out.is_contiguous() and q_out.numel() == H * E
    cfg = QkvConfig(*config) if config is not None else qkv_config(N, D, E, sm_count(weight.device), table)
    assert cfg.half_n == triton.next_power_of_2(cfg.half_n), f"half_n {cfg.half_n} must be a power of 2"
    args = (weight, x, norm_weight, cos, sin, position, q_out, cache_k, cache_v, D, weight.stride(0), float(eps),
            cos.stride(0), sin.stride(0), cache_k.stride(0), cache_k.stride(1), cache_v.stride(0), cache_v.stride(1),
            H, NKV)
    if cfg.stages:
        assert D % cfg.block_k == 0, "streaming: D must be a multiple of block_k"
        n_blocks = (H + 2 * NKV) * triton.cdiv(E // 2, cfg.half_n)
        _qkv_rope_stream_kernel[(min(cfg.programs or n_blocks, n_blocks),)](
            *args, n_blocks, E=E, HALF_N=cfg.half_n, BLOCK_K=cfg.block_k, K_POW2=triton.next_power_of_2(D),
            STAGES=cfg.stages, num_warps=cfg.warps, num_stages=cfg.stages, PDL=pdl_available(x))
        return q_out
    block_k = triton.next_power_of_2(D)
    _qkv_rope_kernel[((H + 2 * NKV) * triton.cdiv(E // 2, cfg.half_n),)](
        *args, E=E, HALF_N=cfg.half_n, BLOCK_K=block_k, EVEN_K=block_k == D, num_warps=cfg.warps,
        PDL=pdl_available(x))
    return q_out
