"""Decode attention in Triton: ONE new token's H query heads over the KV cache, split along the sequence.

Flash-decoding: with one query there is no query dimension to spread over the GPU, so the cache's sequence axis is
cut into splits of `split_len` slots. Kernel 1 (grid K × splits) computes, for each split, the unnormalized
partial output and its softmax statistics (max m, sum l, exp2 domain) for all H/K query heads of one kv head at
once, so each K/V row is read from memory once. Kernel 2 (grid H) combines the splits:
    out = Σ_s 2^(m_s − M) · acc_s / Σ_s 2^(m_s − M) · l_s,   M = max_s m_s.

The context length comes from a device tensor (the new token's position; it sees slots 0..pos), and the grid is
sized for `max_len` slots (default: the cache capacity), so a CUDA graph captured once serves every step: splits
past the current length run an empty loop and record m = −inf, l = 0, acc = 0, which the reduction weighs as 0.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .flash_attn import LOG2E, dot_precision


@triton.jit
def _decode_split_kernel(Q, CK, CV, POS, ACC, M, L, sq_h, sk_k, sk_s, sv_k, sv_s, E, G, split_len, n_splits,
                         qk_scale, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr,
                         DOT_PRECISION: tl.constexpr):
    kh = tl.program_id(0)
    split = tl.program_id(1)
    ctx = tl.load(POS).to(tl.int32) + 1  # slots 0..pos hold this sequence (the new token's k/v included)
    start = split * split_len
    end = tl.minimum(start + split_len, ctx)
    offs_g = tl.arange(0, BLOCK_G)
    g_ok = offs_g < G
    heads = kh * G + offs_g  # the query heads that read kv head kh
    offs_e = tl.arange(0, BLOCK_E)
    e_ok = offs_e < E
    # [G, E], padded to 16 rows for tl.dot; padding rows are zeros and never stored
    q = tl.load(Q + heads[:, None] * sq_h + offs_e[None, :], mask=g_ok[:, None] & e_ok[None, :], other=0.0)
    CK = CK + kh * sk_k
    CV = CV + kh * sv_k

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_E], tl.float32)
    for n0 in range(start, end, BLOCK_N):  # empty when this split lies past the context
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < end
        kt = tl.load(CK + offs_n[None, :] * sk_s + offs_e[:, None], mask=n_ok[None, :] & e_ok[:, None], other=0.0)
        s = tl.dot(q, kt, input_precision=DOT_PRECISION) * qk_scale  # [G, E] @ [E, N] -> [G, N]
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(CV + offs_n[:, None] * sv_s + offs_e[None, :], mask=n_ok[:, None] & e_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)  # [G, N] @ [N, E]
        m_i = m_new
    row = heads * n_splits + split  # partials laid out [H, splits, (E)]
    tl.store(M + row, m_i, mask=g_ok)
    tl.store(L + row, l_i, mask=g_ok)
    tl.store(ACC + row[:, None] * E + offs_e[None, :], acc, mask=g_ok[:, None] & e_ok[None, :])


@triton.jit
def _decode_reduce_kernel(ACC, M, L, O, so_h, E, n_splits, BLOCK_S: tl.constexpr, BLOCK_E: tl.constexpr):
    h = tl.program_id(0)
    offs_s = tl.arange(0, BLOCK_S)
    s_ok = offs_s < n_splits
    offs_e = tl.arange(0, BLOCK_E)
    e_ok = offs_e < E
    m = tl.load(M + h * n_splits + offs_s, mask=s_ok, other=float("-inf"))  # [splits]
    l = tl.load(L + h * n_splits + offs_s, mask=s_ok, other=0.0)
    acc = tl.load(ACC + (h * n_splits + offs_s)[:, None] * E + offs_e[None, :], mask=s_ok[:, None] & e_ok[None, :],
                  other=0.0)  # [splits, E]
    w = tl.exp2(m - tl.max(m, axis=0))  # split 0 always holds slot 0, so the max is finite; empty splits weigh 0
    out = tl.sum(w[:, None] * acc, axis=0) / tl.sum(w * l, axis=0)
    tl.store(O + h * so_h + offs_e, out.to(O.dtype.element_ty), mask=e_ok)


def default_split_len(max_len: int, block_n: int = 64) -> int:
    """At most 64 splits (64 × 8 kv heads = 512 programs, ~4 per SM on 132 SMs) and at least one block each."""
    per_split = triton.cdiv(max_len, 64)
    return max(block_n, triton.cdiv(per_split, block_n) * block_n)


def decode_attention_fwd(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, position: torch.Tensor,
                         out: torch.Tensor | None = None, max_len: int | None = None,
                         split_len: int | None = None) -> torch.Tensor:
    """q [1, H, E] (or [H, E]; rotated, head rows contiguous), cache_k/cache_v [K, S, E] holding slots 0..pos,
    position [1] int (device): the new token's position -> out shaped like q, in q's dtype.

    The grid covers `max_len` slots (default S, the capacity) in splits of `split_len` (a multiple of 16;
    default `default_split_len(max_len)`); the actual length pos + 1 is read on the device.
    """
    H, E = q.shape[-2:]
    NK, S, _ = cache_k.shape
    assert H % NK == 0 and E <= 128 and q.stride(-1) == 1 and cache_k.stride(2) == 1 and cache_v.stride(2) == 1
    assert position.numel() == 1
    max_len = S if max_len is None else max_len
    block_n = 64 if q.is_cuda else 16
    split_len = default_split_len(max_len, block_n) if split_len is None else split_len
    block_n = min(block_n, split_len)
    assert split_len % block_n == 0 and block_n >= 16, "split_len must be a multiple of 16"
    n_splits = triton.cdiv(max_len, split_len)
    G = H // NK
    acc = torch.empty((H, n_splits, E), dtype=torch.float32, device=q.device)
    m = torch.empty((H, n_splits), dtype=torch.float32, device=q.device)
    l = torch.empty((H, n_splits), dtype=torch.float32, device=q.device)
    block_e = max(16, triton.next_power_of_2(E))
    _decode_split_kernel[(NK, n_splits)](q, cache_k, cache_v, position, acc, m, l, q.stride(-2), cache_k.stride(0),
                                         cache_k.stride(1), cache_v.stride(0), cache_v.stride(1), E, G, split_len,
                                         n_splits, LOG2E / math.sqrt(E), BLOCK_G=max(16, triton.next_power_of_2(G)),
                                         BLOCK_N=block_n, BLOCK_E=block_e, DOT_PRECISION=dot_precision(q.dtype),
                                         num_warps=4, num_stages=3)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    _decode_reduce_kernel[(H,)](acc, m, l, out, out.stride(-2), E, n_splits,
                                BLOCK_S=triton.next_power_of_2(n_splits), BLOCK_E=block_e, num_warps=4)
    return out
