"""Rotary position embedding in Triton (HF's half-split "rotate_half" layout), q and k in one launch.

For a head row x [E]: out[:E/2] = x1·cos − x2·sin, out[E/2:] = x2·cos + x1·sin, cos/sin [T, E/2] fp32.
The rotation is computed in fp32 and cast back to the activation dtype (refimpl.interface's dtype rules).

Two launchers:
  * `rope_fwd`: q [T, H, E], k [T, K, E] -> rotated copies (the op interface's `rope`);
  * `rope_kv_write_fwd`: rotates q, and writes rotated k and plain v straight into the static KV cache at
    `positions` (one launch instead of rope + two cache copies; the decode step is launch-bound, so launches count).
One program handles one (token, head) row: grid (T, H + K) or (T, H + 2K).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_row(SRC, DST, COS, SIN, half, ROTATE: tl.constexpr, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    inside = cols < half
    x1 = tl.load(SRC + cols, mask=inside, other=0.0).to(tl.float32)
    x2 = tl.load(SRC + half + cols, mask=inside, other=0.0).to(tl.float32)
    if ROTATE:
        c = tl.load(COS + cols, mask=inside, other=1.0)
        s = tl.load(SIN + cols, mask=inside, other=0.0)
        y1 = x1 * c - x2 * s
        y2 = x2 * c + x1 * s
    else:  # v rows: a plain copy into the cache
        y1 = x1
        y2 = x2
    tl.store(DST + cols, y1.to(DST.dtype.element_ty), mask=inside)
    tl.store(DST + half + cols, y2.to(DST.dtype.element_ty), mask=inside)


@triton.jit
def _rope_kernel(Q, K, QO, KO, COS, SIN, sq_t, sq_h, sk_t, sk_h, sqo_t, sqo_h, sko_t, sko_h, s_cos, s_sin,
                 H, half, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    head = tl.program_id(1)  # 0..H-1: a query head; H..H+K-1: a key head
    cos_row = COS + t * s_cos
    sin_row = SIN + t * s_sin
    if head < H:
        _rotate_row(Q + t * sq_t + head * sq_h, QO + t * sqo_t + head * sqo_h, cos_row, sin_row, half, True, BLOCK)
    else:
        kh = head - H
        _rotate_row(K + t * sk_t + kh * sk_h, KO + t * sko_t + kh * sko_h, cos_row, sin_row, half, True, BLOCK)


@triton.jit
def _rope_kv_write_kernel(Q, K, V, QO, CK, CV, COS, SIN, POS, sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sqo_t, sqo_h,
                          sc_k, sc_s, scv_k, scv_s, s_cos, s_sin, H, NK, half, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    head = tl.program_id(1)  # [0, H): q head; [H, H+K): k head -> cache_k; [H+K, H+2K): v head -> cache_v
    cos_row = COS + t * s_cos
    sin_row = SIN + t * s_sin
    if head < H:
        _rotate_row(Q + t * sq_t + head * sq_h, QO + t * sqo_t + head * sqo_h, cos_row, sin_row, half, True, BLOCK)
    else:
        pos = tl.load(POS + t).to(tl.int64)
        if head < H + NK:
            kh = head - H
            _rotate_row(K + t * sk_t + kh * sk_h, CK + kh * sc_k + pos * sc_s, cos_row, sin_row, half, True, BLOCK)
        else:
            kh = head - H - NK
            _rotate_row(V + t * sv_t + kh * sv_h, CV + kh * scv_k + pos * scv_s, cos_row, sin_row, half, False,
                        BLOCK)


def _check_heads(*tensors):
    for x in tensors:
        assert x.dim() == 3 and x.stride(2) == 1, "expected [T, heads, E] with contiguous head rows"


def rope_fwd(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             q_out: torch.Tensor | None = None, k_out: torch.Tensor | None = None):
    """q [T, H, E], k [T, K, E], cos/sin [T, E/2] fp32 -> (q_rot, k_rot). Outputs may alias the inputs."""
    _check_heads(q, k)
    T, H, E = q.shape
    q_out = torch.empty_like(q) if q_out is None else q_out
    k_out = torch.empty_like(k) if k_out is None else k_out
    _check_heads(q_out, k_out)
    assert cos.stride(1) == 1 and sin.stride(1) == 1 and cos.shape == (T, E // 2)
    _rope_kernel[(T, H + k.shape[1])](q, k, q_out, k_out, cos, sin, q.stride(0), q.stride(1), k.stride(0),
                                      k.stride(1), q_out.stride(0), q_out.stride(1), k_out.stride(0),
                                      k_out.stride(1), cos.stride(0), sin.stride(0), H, E // 2,
                                      BLOCK=triton.next_power_of_2(E // 2), num_warps=1)
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
    _rope_kv_write_kernel[(T, H + 2 * NK)](
        q, k, v, q_out, cache_k, cache_v, cos, sin, positions, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), q_out.stride(0), q_out.stride(1), cache_k.stride(0), cache_k.stride(1),
        cache_v.stride(0), cache_v.stride(1), cos.stride(0), sin.stride(0), H, NK, E // 2,
        BLOCK=triton.next_power_of_2(E // 2), num_warps=1)
    return q_out
