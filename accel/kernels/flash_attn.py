"""Flash-attention forward for prefill, in Triton: causal by absolute position, native GQA, over the static KV cache.

The caller has already written this chunk's k/v into the cache; query t (at position positions[t]) attends to
cache slots 0..positions[t]. Query head h reads kv head h // (H/K) straight from the [K, S, E] cache, so repeated
K/V are never materialized. Online softmax (running max m, running sum l, unnormalized accumulator) in fp32, in the
exp2 domain: raw scores are scaled by log2(e)/sqrt(E) inside the one FMA that also subtracts the running max.

One program = one block of BLOCK_M queries × one query head. Its key loop has two phases: blocks of keys every
query of the block may see (no causal mask and no bounds checks: they always lie inside the context — the bulk
of a long prefill) and the diagonal blocks (masked per query, loads bounded by the block's last visible slot).
Any T (rows past T are masked), any E up to 128 (padded to a power of two; BLOCK_E >= 16 for tl.dot).
K/V tiles come either through plain pointers or, on Hopper with USE_DESC, through tensor descriptors (TMA).
The same kernel runs Mllama's prefill cross-attention (`cross_attention_fwd`, CROSS): no causal structure, every
query over all image keys with the cross-attention mask tile-loaded beside the keys, q_norm applied on the loaded
queries; a row may see no key in a whole block, so the online softmax subtracts a finite max (`finite_max`).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .common import gdc_wait, launch_pdl, pdl_available, pdl_kw

LOG2E = 1.4426950408889634

try:  # host-side TMA descriptors (triton >= 3.4); absent: the pointer path only
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs: exact IEEE products (the GPU default would be TF32, ~3e-4 relative, far from refimpl);
    bf16/fp16 inputs use the tensor cores whatever this says."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def load_kv(CK, CV, DK, DV, kh, start, offs_n, offs_e, e_ok, key_limit, sk_s, sv_s,
             MASKED: tl.constexpr, EVEN_E: tl.constexpr, USE_DESC: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_E: tl.constexpr):
    """K and V tiles [N, E] of keys start..start+N. Unmasked blocks lie inside the context: no bounds checks.
    Masked (diagonal) blocks may reach past the last written slot, whose contents are arbitrary (NaN in the
    tests): K there only feeds scores the causal mask discards, but 0 · NaN = NaN in P·V, so V is zeroed."""
    if USE_DESC:
        k = DK.load([kh, start, 0]).reshape(BLOCK_N, BLOCK_E)
        v = DV.load([kh, start, 0]).reshape(BLOCK_N, BLOCK_E)
        if MASKED:
            v = tl.where((start + offs_n < key_limit)[:, None], v, 0.0)
    else:
        k, v = load_kv_tiles(CK, CV, start, offs_n, offs_e, e_ok, key_limit, sk_s, sv_s, MASKED, EVEN_E)
    return k, v


@triton.jit
def load_kv_tiles(CK, CV, start, offs_n, offs_e, e_ok, key_limit, sk_s, sv_s, MASKED: tl.constexpr,
                  EVEN_E: tl.constexpr):
    """K and V tiles [N, E] of slots start..start+N through plain pointers (also decode_attn.py's): masked
    blocks read zeros at slots >= key_limit, so V there is 0, never the slot's arbitrary contents."""
    kp = CK + (start + offs_n)[:, None] * sk_s + offs_e[None, :]
    vp = CV + (start + offs_n)[:, None] * sv_s + offs_e[None, :]
    if MASKED:
        ok = (start + offs_n < key_limit)[:, None] & e_ok[None, :]
        return tl.load(kp, mask=ok, other=0.0), tl.load(vp, mask=ok, other=0.0)
    if EVEN_E:
        return tl.load(kp), tl.load(vp)
    return tl.load(kp, mask=e_ok[None, :], other=0.0), tl.load(vp, mask=e_ok[None, :], other=0.0)


@triton.jit
def rms_norm_rows(q, NW, offs_e, e_ok, E, eps):
    """q [M, BLOCK_E] (zeros past E) -> each row RMSNorm'd by NW [E] in HF's order (accel/kernels/rms_norm.py):
    Mllama's q_norm over a head, done where the query is loaded instead of in a launch of its own."""
    qf = q.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(qf * qf, axis=1) / E + eps)  # [M]
    w = tl.load(NW + offs_e, mask=e_ok, other=0.0).to(tl.float32)
    normed = (qf * rstd[:, None]).to(q.dtype)
    return (normed.to(tl.float32) * w[None, :]).to(q.dtype)


@triton.jit
def finite_max(m, MASKABLE: tl.constexpr):
    """The running max to subtract. Under a mask a row may have seen no key yet (m = -inf): subtract 0 there, so
    that exp2(-inf - m) is 0 and not NaN (causal rows always see key 0 first: no check)."""
    if MASKABLE:
        return tl.where(m == float("-inf"), 0.0, m)
    return m


@triton.jit
def _attend_block(acc, m_i, l_i, q, CK, CV, DK, DV, kh, start, offs_n, offs_e, e_ok, key_limit, pos, vis_rows,
                  row_ok, sk_s, sv_s, qk_scale, MASKED: tl.constexpr, EVEN_E: tl.constexpr, USE_DESC: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, DOT_PRECISION: tl.constexpr, CROSS: tl.constexpr):
    k, v = load_kv(CK, CV, DK, DV, kh, start, offs_n, offs_e, e_ok, key_limit, sk_s, sv_s, MASKED, EVEN_E,
                    USE_DESC, BLOCK_N, BLOCK_E)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [M, E] @ [E, N] -> [M, N], raw scores
    if CROSS:  # the cross-attention mask, [M, N] of vis_rows [M, 1] row pointers
        ok = row_ok[:, None] & (start + offs_n < key_limit)[None, :]
        seen = tl.load(vis_rows + (start + offs_n)[None, :], mask=ok, other=0) != 0
        s = tl.where(seen, s, float("-inf"))
    elif MASKED:
        s = tl.where((start + offs_n)[None, :] <= pos[:, None], s, float("-inf"))  # causal by absolute position
    m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)  # log2 domain (qk_scale > 0 commutes with max)
    m_use = finite_max(m_new, CROSS)
    p = tl.exp2(s * qk_scale - m_use[:, None])  # one FMA per score, then the exp2
    alpha = tl.exp2(m_i - m_use)  # rescales what was accumulated under the old max (0 on the first block)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)  # += [M, N] @ [N, E], in place
    return acc, m_new, l_i


@triton.jit
def _flash_fwd_kernel(Q, CK, CV, DK, DV, POS, VIS, QNW, O, sq_t, sq_h, sk_k, sk_s, sv_k, sv_s, so_t, so_h, svis_t,
                      T, n_keys, eps, E: tl.constexpr, G, n_mblocks, qk_scale, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, USE_DESC: tl.constexpr,
                      DOT_PRECISION: tl.constexpr, CROSS: tl.constexpr, PDL: tl.constexpr = False):
    """CROSS: Mllama's cross-attention instead of the causal mask: every query over all n_keys image keys,
    query t seeing key n where VIS[t, n] != 0, the queries RMSNorm'd per head by QNW (q_norm) once loaded.
    PDL: launched as a programmatic dependent (accel.kernels.common.pdl_launches): wait for the previous kernel
    before touching memory."""
    if PDL:
        gdc_wait()
    # heads vary fastest and query blocks run last-first: under the causal mask the last blocks have the most
    # keys, so the whole launch schedules longest-first across all heads and the tail wave is short
    h = tl.program_id(0)
    kh = h // G  # native GQA: this query head's kv head
    offs_m = (n_mblocks - 1 - tl.program_id(1)) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < T
    offs_n = tl.arange(0, BLOCK_N)
    offs_e = tl.arange(0, BLOCK_E)
    EVEN_E: tl.constexpr = BLOCK_E == E
    e_ok = offs_e < E
    q = tl.load(Q + offs_m[:, None] * sq_t + h * sq_h + offs_e[None, :], mask=row_ok[:, None] & e_ok[None, :],
                other=0.0)  # [M, E]
    vis_rows = VIS + offs_m[:, None].to(tl.int64) * svis_t  # [M, 1] (CROSS only)
    if CROSS:
        pos = offs_m  # unused
        q = rms_norm_rows(q, QNW, offs_e, e_ok, E, eps)
        key_limit = n_keys
        full_end = (n_keys // BLOCK_N) * BLOCK_N  # whole blocks: the mask only, no bounds checks
    else:
        pos = tl.load(POS + offs_m, mask=row_ok, other=0).to(tl.int32)  # [M]
        key_limit = tl.max(pos, axis=0) + 1  # no query of this block sees a key at or past this slot
        seen_by_all = tl.min(tl.where(row_ok, pos, 2147483647), axis=0) + 1  # keys [0, this) seen by every row
        full_end = (seen_by_all // BLOCK_N) * BLOCK_N
    CK = CK + kh * sk_k
    CV = CV + kh * sv_k

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_E], tl.float32)
    for start in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, CK, CV, DK, DV, kh, start, offs_n, offs_e, e_ok, key_limit,
                                      pos, vis_rows, row_ok, sk_s, sv_s, qk_scale, False, EVEN_E, USE_DESC, BLOCK_N,
                                      BLOCK_E, DOT_PRECISION, CROSS)
    for start in range(full_end, key_limit, BLOCK_N):
        acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, CK, CV, DK, DV, kh, start, offs_n, offs_e, e_ok, key_limit,
                                      pos, vis_rows, row_ok, sk_s, sv_s, qk_scale, True, EVEN_E, USE_DESC, BLOCK_N,
                                      BLOCK_E, DOT_PRECISION, CROSS)
    if CROSS:  # rows past T saw nothing (l = 0); every real row sees some key (the caller's contract)
        l_i = tl.where(row_ok, l_i, 1.0)
    out = acc / l_i[:, None]  # causal: every row sees key 0, so l_i >= 1
    tl.store(O + offs_m[:, None] * so_t + h * so_h + offs_e[None, :], out.to(O.dtype.element_ty),
             mask=row_ok[:, None] & e_ok[None, :])


def _config(T: int, E: int, dtype: torch.dtype, on_gpu: bool) -> dict:
    """Tile sizes: the fastest of an attention sweep (bf16, causal, 8 kv heads, T=8192; figures in
    docs/performance.md): E=64 64×64 tiles, 4 warps, 3 stages (TMA: no gain); E=128 128×128, 8 warps, 3 stages
    with TMA descriptors (4 stages of 128×128 exceed the 227 KB of shared memory), else 128×64.
    fp32 halves the tiles to stay under the shared memory. Small T (and the interpreter) get small blocks."""
    if not on_gpu:
        return dict(BLOCK_M=max(16, min(32, triton.next_power_of_2(T))), BLOCK_N=32, num_warps=4, num_stages=3,
                    USE_DESC=False)
    if dtype == torch.float32:
        return dict(BLOCK_M=max(16, min(64, triton.next_power_of_2(T))), BLOCK_N=32, num_warps=4, num_stages=2,
                    USE_DESC=False)
    if E <= 64:
        return dict(BLOCK_M=max(16, min(64, triton.next_power_of_2(T))), BLOCK_N=64, num_warps=4, num_stages=3,
                    USE_DESC=False)
    block_m = max(16, min(128, triton.next_power_of_2(T)))
    return dict(BLOCK_M=block_m, BLOCK_N=128 if block_m == 128 else 64, num_warps=8 if block_m == 128 else 4,
                num_stages=3, USE_DESC=block_m == 128)


def _tma_fallback(cfg: dict) -> dict:
    """The pointer path's tiles when a TMA config cannot get its descriptors (E=128: 128×64 beat 128×128)."""
    return {**cfg, "BLOCK_N": 64} if cfg["BLOCK_M"] == 128 and cfg["num_warps"] == 8 else cfg


def kv_descriptors(cache_k, cache_v, block_n: int, block_e: int, use: bool):
    """TMA descriptors over the [K, S, E] caches (tiles [1, BLOCK_N, BLOCK_E]); None where not usable:
    no host descriptors in this triton, not on CUDA sm_90+, or strides/base not 16-byte aligned."""
    if not (use and TensorDescriptor is not None and pdl_available(cache_k) and block_e == cache_k.shape[2]):
        return None
    try:
        return tuple(TensorDescriptor(c, list(c.shape), list(c.stride()), [1, block_n, block_e])
                     for c in (cache_k, cache_v))
    except AssertionError:  # alignment: fall back to pointers
        return None


def flash_attention_fwd(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, positions: torch.Tensor,
                        out: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """q [T, H, E] (rotated; head rows contiguous), cache_k/cache_v [K, S, E] already holding slots
    0..max(positions), positions [T] int (device) -> out [T, H, E] in q's dtype. No host synchronization.
    `config` overrides the tile sizes of `_config` (BLOCK_M, BLOCK_N, num_warps, num_stages, USE_DESC): for
    tuning sweeps."""
    assert positions.shape == (q.shape[0],)
    return _launch(q, cache_k, cache_v, positions, None, None, 0.0, out, config)


def cross_attention_fwd(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor,
                        norm_weight: torch.Tensor, eps: float, out: torch.Tensor | None = None,
                        config: dict | None = None) -> torch.Tensor:
    """Mllama's prefill cross-attention: q [T, H, E] (before q_norm; head rows contiguous) RMSNorm'd per head by
    norm_weight [E], over all N image keys/values [K, N, E], query t seeing key n where visible[t, n] (bool or
    uint8 [T, N], unit stride along N; every row with at least one key) -> out [T, H, E] in q's dtype."""
    T, N = q.shape[0], keys.shape[1]
    assert visible.shape == (T, N) and visible.stride(1) == 1 and norm_weight.shape == (q.shape[2],)
    vis = visible.view(torch.uint8) if visible.dtype == torch.bool else visible
    return _launch(q, keys, values, None, vis, norm_weight, eps, out, config)


def _launch(q, cache_k, cache_v, positions, visible, norm_weight, eps, out, config):
    T, H, E = q.shape
    NK, S, _ = cache_k.shape
    assert H % NK == 0 and E <= 128 and q.stride(2) == 1 and cache_k.stride(2) == 1 and cache_v.stride(2) == 1
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    cfg = {**_config(T, E, q.dtype, q.is_cuda), **(config or {})}
    block_e = max(16, triton.next_power_of_2(E))
    cross = visible is not None
    if cross and config is None:  # the mask tile's stages on top of 128 × 128 K/V stages exceed shared memory
        cfg = _tma_fallback(cfg)
    use_desc = cfg.pop("USE_DESC")
    descs = kv_descriptors(cache_k, cache_v, cfg["BLOCK_N"], block_e, use_desc)
    if use_desc and descs is None and config is None:
        cfg = _tma_fallback(cfg)
    dk, dv = descs if descs else (cache_k, cache_v)  # unused placeholders on the pointer path
    n_mblocks = triton.cdiv(T, cfg["BLOCK_M"])
    pdl = launch_pdl(q)
    _flash_fwd_kernel[(H, n_mblocks)](q, cache_k, cache_v, dk, dv, q if cross else positions,
                                      visible if cross else q, norm_weight if cross else q, out, q.stride(0),
                                      q.stride(1), cache_k.stride(0), cache_k.stride(1), cache_v.stride(0),
                                      cache_v.stride(1), out.stride(0), out.stride(1),
                                      visible.stride(0) if cross else 0, T, S, float(eps), E, H // NK,
                                      n_mblocks, LOG2E / math.sqrt(E), BLOCK_E=block_e, USE_DESC=descs is not None,
                                      DOT_PRECISION=dot_precision(q.dtype), CROSS=cross, PDL=pdl, **cfg,
                                      **pdl_kw(pdl))
    return out
