"""Non-causal flash attention for the vision encoder, in Triton. Every token of an image attends every token of the
image except that pairs of two padding tokens are blocked (HF's `_prepare_aspect_ratio_attention_mask`), given
here as one "is padding" flag per token, never as an [L, L] mask.

Why not flash_attn_bwd's forward (the training one): it pads the head dim to a power of two (the encoder's 80 ->
128: 1.6x the tensor-core work of both matmuls) and reads a dense mask per score. Here E splits into a power-of-two
part and a tail (80 = 64 + 16), each its own dot, and a query block without padding rows (nearly all of them)
runs the unmasked loop: the mask costs only the few blocks that hold padding rows.

Layout: q/k/v [B, L, H, E] with any batch/token/head strides (views of one fused QKV GEMM output [B·L, 3·H·E]),
pad [B, L] uint8 (nonzero = padding token) or None, o [B, L, H, E]. Online softmax in fp32 in the exp2 domain, as
flash_attn.py.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .flash_attn import LOG2E, dot_precision


@triton.jit
def _kv_tiles(Kb, Vb, keys, offs_e0, offs_e1, e0_ok, e1_ok, L, sk_t, sv_t, E0: tl.constexpr, HAS_TAIL: tl.constexpr,
              SHORT: tl.constexpr, CHECK_L: tl.constexpr):
    """K and V tiles of `keys`: the power-of-two head columns [N, E0] and the tail [N, E1] (zeros past E, and
    zeros for keys >= L when CHECK_L). Without a tail the tail tiles are the E0 ones (never used). SHORT: E < 16,
    the E0 tile itself reaches past E."""
    ok = keys < L
    kp = Kb + keys[:, None] * sk_t
    vp = Vb + keys[:, None] * sv_t
    if CHECK_L or SHORT:
        m0 = ok[:, None] & e0_ok[None, :]
        k0 = tl.load(kp + offs_e0[None, :], mask=m0, other=0.0)
        v0 = tl.load(vp + offs_e0[None, :], mask=m0, other=0.0)
    else:
        k0 = tl.load(kp + offs_e0[None, :])
        v0 = tl.load(vp + offs_e0[None, :])
    if HAS_TAIL:
        tail = e1_ok[None, :] & ok[:, None] if CHECK_L else e1_ok[None, :]
        k1 = tl.load(kp + E0 + offs_e1[None, :], mask=tail, other=0.0)
        v1 = tl.load(vp + E0 + offs_e1[None, :], mask=tail, other=0.0)
    else:
        k1, v1 = k0, v0
    return k0, v0, k1, v1


@triton.jit
def _block(acc0, acc1, m_i, l_i, q0, q1, pad_q, Kb, Vb, PADb, start, offs_n, offs_e0, offs_e1, e0_ok, e1_ok, L,
           sk_t, sv_t, qk_scale, E0: tl.constexpr, HAS_TAIL: tl.constexpr, SHORT: tl.constexpr, CHECK_L: tl.constexpr,
           PAD: tl.constexpr, DOT_PRECISION: tl.constexpr):
    keys = start + offs_n
    k0, v0, k1, v1 = _kv_tiles(Kb, Vb, keys, offs_e0, offs_e1, e0_ok, e1_ok, L, sk_t, sv_t, E0, HAS_TAIL, SHORT,
                               CHECK_L)
    s = tl.dot(q0, tl.trans(k0), input_precision=DOT_PRECISION)  # [M, E0] @ [E0, N] -> [M, N]
    if HAS_TAIL:
        s = tl.dot(q1, tl.trans(k1), s, input_precision=DOT_PRECISION)  # += [M, E1] @ [E1, N]
    if CHECK_L:
        s = tl.where((keys < L)[None, :], s, float("-inf"))
    if PAD:  # pad×pad pairs blocked
        pad_k = tl.load(PADb + keys, mask=keys < L, other=0)
        s = tl.where((pad_q[:, None] != 0) & (pad_k[None, :] != 0), float("-inf"), s)
    m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
    m_use = m_new
    if PAD:  # a padding row may have met only padding keys so far: keep -inf - -inf out of the exponents
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s * qk_scale - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc0 = tl.dot(p.to(v0.dtype), v0, acc0 * alpha[:, None], input_precision=DOT_PRECISION)  # += [M, N] @ [N, E0]
    if HAS_TAIL:
        acc1 = tl.dot(p.to(v1.dtype), v1, acc1 * alpha[:, None], input_precision=DOT_PRECISION)  # += [M, N] @ [N, E1]
    return acc0, acc1, m_new, l_i


@triton.jit
def _encoder_attn_kernel(Q, K, V, PAD, O, sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, so_b, so_t, so_h, L, H,
                         qk_scale, E: tl.constexpr, E0: tl.constexpr, E1: tl.constexpr, HAS_PAD: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    bh = tl.program_id(0)  # heads fastest: the programs running together share their image's K/V in L2
    b = (bh // H).to(tl.int64)
    h = bh % H
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < L
    offs_n = tl.arange(0, BLOCK_N)
    offs_e0 = tl.arange(0, E0)
    offs_e1 = tl.arange(0, E1)
    HAS_TAIL: tl.constexpr = E > E0
    SHORT: tl.constexpr = E < E0
    e0_ok = offs_e0 < E
    e1_ok = E0 + offs_e1 < E
    qp = Q + b * sq_b + h * sq_h + offs_m[:, None] * sq_t
    q0 = tl.load(qp + offs_e0[None, :], mask=row_ok[:, None] & e0_ok[None, :], other=0.0)  # [M, E0]
    if HAS_TAIL:
        q1 = tl.load(qp + E0 + offs_e1[None, :], mask=row_ok[:, None] & e1_ok[None, :], other=0.0)  # [M, E1]
    else:
        q1 = q0
    Kb = K + b * sk_b + h * sk_h
    Vb = V + b * sv_b + h * sv_h
    PADb = PAD + b * L
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc0 = tl.zeros([BLOCK_M, E0], tl.float32)
    acc1 = tl.zeros([BLOCK_M, E1], tl.float32)
    full_end = (L // BLOCK_N) * BLOCK_N
    pad_q = tl.zeros([BLOCK_M], tl.int8)
    padded = 0
    if HAS_PAD:
        pad_q = tl.load(PADb + offs_m, mask=row_ok, other=0).to(tl.int8)
        padded = tl.max(pad_q, axis=0)
    if padded != 0:  # this block holds padding rows: every key block masked
        for start in range(0, L, BLOCK_N):
            acc0, acc1, m_i, l_i = _block(acc0, acc1, m_i, l_i, q0, q1, pad_q, Kb, Vb, PADb, start, offs_n, offs_e0,
                                          offs_e1, e0_ok, e1_ok, L, sk_t, sv_t, qk_scale, E0, HAS_TAIL, SHORT, True, True,
                                          DOT_PRECISION)
    else:  # whole key blocks without bounds checks, then the ragged last one
        for start in range(0, full_end, BLOCK_N):
            acc0, acc1, m_i, l_i = _block(acc0, acc1, m_i, l_i, q0, q1, pad_q, Kb, Vb, PADb, start, offs_n, offs_e0,
                                          offs_e1, e0_ok, e1_ok, L, sk_t, sv_t, qk_scale, E0, HAS_TAIL, SHORT, False, False,
                                          DOT_PRECISION)
        for start in range(full_end, L, BLOCK_N):
            acc0, acc1, m_i, l_i = _block(acc0, acc1, m_i, l_i, q0, q1, pad_q, Kb, Vb, PADb, start, offs_n, offs_e0,
                                          offs_e1, e0_ok, e1_ok, L, sk_t, sv_t, qk_scale, E0, HAS_TAIL, SHORT, True, False,
                                          DOT_PRECISION)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # a row that saw no key (an image of padding only) outputs 0
    op = O + b * so_b + h * so_h + offs_m[:, None] * so_t
    tl.store(op + offs_e0[None, :], (acc0 / l_safe[:, None]).to(O.dtype.element_ty),
             mask=row_ok[:, None] & e0_ok[None, :])
    if HAS_TAIL:
        tl.store(op + E0 + offs_e1[None, :], (acc1 / l_safe[:, None]).to(O.dtype.element_ty),
                 mask=row_ok[:, None] & e1_ok[None, :])


def head_split(E: int) -> tuple[int, int]:
    """E -> (E0, E1): the largest power of two <= E (at least 16, tl.dot's minimum: E < 16 is padded) and the tail
    padded to a power of two >= 16 (a placeholder when E <= E0). 80 -> (64, 16), 64 -> (64, 16), 8 -> (16, 16)."""
    e0 = max(16, 1 << (E.bit_length() - 1))
    return e0, max(16, triton.next_power_of_2(max(E - e0, 1)))


def default_config(L: int, dtype: torch.dtype, on_gpu: bool) -> dict:
    """Tile sizes (bf16: tools/bench/encoder_attn.py sweep at the 11B encoder's shape; fp32 halves the tiles for
    shared memory; small L and the interpreter get small blocks)."""
    small = max(16, min(32, triton.next_power_of_2(L)))
    if not on_gpu:
        return dict(BLOCK_M=small, BLOCK_N=small, num_warps=4, num_stages=1)
    if dtype == torch.float32:
        return dict(BLOCK_M=max(16, min(64, triton.next_power_of_2(L))), BLOCK_N=32, num_warps=4, num_stages=2)
    return dict(BLOCK_M=max(16, min(128, triton.next_power_of_2(L))), BLOCK_N=max(16, min(64, triton.next_power_of_2(L))),
                num_warps=8, num_stages=3)


def encoder_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pad: torch.Tensor | None = None,
                      out: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """q/k/v [B, L, H, E] (head rows contiguous), pad [B, L] bool/uint8 (True = padding token: pad×pad pairs are
    blocked) or None -> out [B, L, H, E] in q's dtype. Scale 1/sqrt(E). `config` overrides the tile sizes."""
    B, L, H, E = q.shape
    assert k.shape == v.shape == q.shape and E <= 256, (q.shape, k.shape, v.shape)
    assert q.stride(3) == 1 and k.stride(3) == 1 and v.stride(3) == 1, "head rows must be contiguous"
    assert pad is None or pad.shape == (B, L), "pad: [B, L]"
    out = torch.empty((B, L, H, E), dtype=q.dtype, device=q.device) if out is None else out
    padv = q if pad is None else pad.contiguous().view(torch.uint8)
    cfg = {**default_config(L, q.dtype, q.is_cuda), **(config or {})}
    e0, e1 = head_split(E)
    grid = (B * H, triton.cdiv(L, cfg["BLOCK_M"]))
    _encoder_attn_kernel[grid](q, k, v, padv, out, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
                               *out.stride()[:3], L, H, LOG2E / math.sqrt(E), E=E, E0=e0, E1=e1,
                               HAS_PAD=pad is not None, DOT_PRECISION=dot_precision(q.dtype), **cfg)
    return out
