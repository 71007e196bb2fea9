"""Rotary position embedding in Triton (HF's half-split "rotate_half" layout), q and k in one launch.

For a head row x [E]: out[:E/2] = x1·cos − x2·sin, out[E/2:] = x2·cos + x1·sin, cos/sin [T, E/2] fp32.
The rotation is computed in fp32 and cast back to the activation dtype (refimpl.model.interface's dtype rules).

Two launchers:
  * `rope_fwd`: q [T, H, E], k [T, K, E] -> rotated copies (the op interface's `rope`);
  * `rope_kv_write_fwd`: rotates q, and writes rotated k and plain v straight into the static KV cache at
    `positions` (one launch instead of rope + two cache copies; the decode step is launch-bound, so launches count).
One program handles all heads of one token's q, k or v as one [heads, E/2] tile: grid (T, 2) or (T, 3). One
single-warp program per (token, head) was ~9x slower at T = 2048, and one program a token slower at T = 1
(decode), hence the q/k/v split (three programs in parallel for one token; figures in docs/performance.md).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import gdc_wait, launch_pdl, pdl_kw


@triton.jit
def rotate_half(x1, x2, c, s):
    """HF's rotate_half RoPE of a head's two halves x1, x2 (fp32) by cos/sin: the one spelling of the rotation in
    the kernels (rope_kv_write's and the decode step's qkv_rope), so that every path rounds alike."""
    return x1 * c - x2 * s, x2 * c + x1 * s


@triton.jit
def _rotate_heads(SRC, s_h, DST, d_h, n_heads, c, s, half, ROTATE: tl.constexpr, BLOCK_H: tl.constexpr,
                  BLOCK: tl.constexpr):
    """Rows SRC + h·s_h (h < n_heads) -> DST + h·d_h; c, s [1, BLOCK] fp32 (this token's cos/sin)."""
    heads = tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
    cols = tl.arange(0, BLOCK)[None, :]  # [1, BLOCK]
    inside = (heads < n_heads) & (cols < half)
    src = SRC + heads * s_h + cols
    dst = DST + heads * d_h + cols
    x1 = tl.load(src, mask=inside, other=0.0).to(tl.float32)
    x2 = tl.load(src + half, mask=inside, other=0.0).to(tl.float32)
    if ROTATE:
        y1, y2 = rotate_half(x1, x2, c, s)
    else:  # v rows: a plain copy into the cache
        y1 = x1
        y2 = x2
    tl.store(dst, y1.to(DST.dtype.element_ty), mask=inside)
    tl.store(dst + half, y2.to(DST.dtype.element_ty), mask=inside)


@triton.jit
def _cos_sin(COS, SIN, t, s_cos, s_sin, half, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)[None, :]
    inside = cols < half
    return (tl.load(COS + t * s_cos + cols, mask=inside, other=1.0),
            tl.load(SIN + t * s_sin + cols, mask=inside, other=0.0))


@triton.jit
def _rope_kernel(Q, K, QO, KO, COS, SIN, sq_t, sq_h, sk_t, sk_h, sqo_t, sqo_h, sko_t, sko_h, s_cos, s_sin,
                 H, NK, half, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    c, s = _cos_sin(COS, SIN, t, s_cos, s_sin, half, BLOCK)
    if tl.program_id(1) == 0:
        _rotate_heads(Q + t * sq_t, sq_h, QO + t * sqo_t, sqo_h, H, c, s, half, True, BLOCK_H, BLOCK)
    else:
        _rotate_heads(K + t * sk_t, sk_h, KO + t * sko_t, sko_h, NK, c, s, half, True, BLOCK_K, BLOCK)


@triton.jit
def _rope_kv_write_kernel(Q, K, V, QO, CK, CV, COS, SIN, POS, sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sqo_t, sqo_h,
                          sc_k, sc_s, scv_k, scv_s, s_cos, s_sin, H, NK, half, BLOCK_H: tl.constexpr,
                          BLOCK_K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:  # a programmatic dependent (common.pdl_launches): the previous kernel's output first
        gdc_wait()
    t = tl.program_id(0).to(tl.int64)
    c, s = _cos_sin(COS, SIN, t, s_cos, s_sin, half, BLOCK)
    part = tl.program_id(1)  # 0: q, 1: k -> cache_k, 2: v -> cache_v
    if part == 0:
        _rotate_heads(Q + t * sq_t, sq_h, QO + t * sqo_t, sqo_h, H, c, s, half, True, BLOCK_H, BLOCK)
    else:
        pos = tl.load(POS + t).to(tl.int64)
        if part == 1:
            _rotate_heads(K + t * sk_t, sk_h, CK + pos * sc_s, sc_k, NK, c, s, half, True, BLOCK_K, BLOCK)
        else:
            _rotate_heads(V + t * sv_t, sv_h, CV + pos * scv_s, scv_k, NK, c, s, half, False, BLOCK_K, BLOCK)


def _check_heads(*tensors):
    for x in tensors:
        assert x.dim() == 3 and x.stride(2) == 1, "expected [T, heads, E] with contiguous head rows"


def _blocks(H, NK, E):
    return dict(BLOCK_H=triton.next_power_of_2(H), BLOCK_K=triton.next_power_of_2(NK),
                BLOCK=triton.next_power_of_2(E // 2), num_warps=4)


def rope_fwd(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             q_out: torch.Tensor | None = None, k_out: torch.Tensor | None = None):
    """q [T, H, E], k [T, K, E], cos/sin [T, E/2] fp32 -> (q_rot, k_rot). Outputs may alias the inputs."""
    _check_heads(q, k)
    T, H, E = q.shape
    NK = k.shape[1]
    q_out = torch.empty_like(q) if q_out is None else q_out
    k_out = torch.empty_like(k) if k_out is None else k_out
    _check_heads(q_out, k_out)
    assert cos.stride(1) == 1 and sin.stride(1) == 1 and cos.shape == (T, E // 2)
    _rope_kernel[(T, 2)](q, k, q_out, k_out, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                       q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cos.stride(0),
                       sin.stride(0), H, NK, E // 2, **_blocks(H, NK, E))
    return q_out, k_out


def rope_kv_write_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      cache_k: torch.Tensor, cache_v: torch.Tensor, positions: torch.Tensor,
                      q_out: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, E], k/v [T, K, E], cos/sin [T, E/2] fp32, cache_k/cache_v [K, S, E], positions [T] int (device).

    Writes rope(k) into cache_k[:, positions] and v into cache_v[:, positions]; returns rope(q) (into `q_out`).
    """
    _check_heads(q, k, v)
    T, H, E = q.shape
    NK = k.shape[1]
    q_out = torch.empty_like(q) if q_out is None else q_out
    assert cache_k.stride(2) == 1 and cache_v.stride(2) == 1 and cache_k.shape[0] == NK
    assert positions.shape == (T,) and cos.stride(1) == 1 and sin.stride(1) == 1
    pdl = launch_pdl(k)
    _rope_kv_write_kernel[(T, 3)](
        q, k, v, q_out, cache_k, cache_v, cos, sin, positions, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), q_out.stride(0), q_out.stride(1), cache_k.stride(0), cache_k.stride(1),
        cache_v.stride(0), cache_v.stride(1), cos.stride(0), sin.stride(0), H, NK, E // 2, **_blocks(H, NK, E),
        PDL=pdl, **pdl_kw(pdl))
    return q_out
