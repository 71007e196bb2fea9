"""Decode attention in Triton: ONE new token's H query heads over the KV cache, split along the sequence.

Flash-decoding: with one query there is no query dimension to spread over the GPU, so the cache's sequence axis is
cut into splits of `split_len` slots. The split kernel (grid K × splits) computes, for each split, the unnormalized
partial output and its softmax statistics (max m, sum l, exp2 domain) for all H/K query heads of one kv head at
once, so each K/V row is read from memory once. The splits are then combined:
    out = Σ_s 2^(m_s − M) · acc_s / Σ_s 2^(m_s − M) · l_s,   M = max_s m_s.
Combining happens either in a second kernel (grid H), or — FUSED — inside the split kernel: each program counts
itself done on a per-kv-head counter, and the program that arrives last combines that kv head's splits, saving a
launch and its gap. The counter is returned to 0 by that last program, so the next launch (or graph replay) finds
it zeroed; launches that share a counter buffer must therefore not run concurrently (one stream: true here).

PDL (programmatic dependent launch, the decode step's launch on the GPU for caches of LONG_CONTEXT slots or more;
at shorter ones it made the step slower, docs/performance.md): the kernel is launched so that its
programs may start while the previous kernel in the stream (the decode step's qkv_rope, which lets dependents
launch early) is still running. Before `gdc_wait` — which returns once that kernel has finished and its writes are
visible — a program only reads the position and prefetches the first PREFETCH slots of its split into L2 (a hint:
L2 is coherent, so a slot being written meanwhile is still read fresh after the wait). So with `pdl=True` the
previous kernel may write q and the cache, but not the position.

The context length comes from a device tensor (the new token's position; it sees slots 0..pos), and the grid is
sized for `max_len` slots (default: the cache capacity), so a CUDA graph captured once serves every step: splits
past the current length run an empty loop and record m = −inf, l = 0, acc = 0, which the combination weighs as 0.

`cross_decode_attention_fwd` runs the same kernels for Mllama's decode-step cross-attention (CROSS): the length is
the image token count, a per-key mask hides image tokens (padding tiles, other images), q_norm is applied to the
loaded query heads (unless no norm weight is given: the vision encoder's padding rows), and splits whose keys are
all hidden weigh 0 in the combination like empty ones.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .common import (CaptureBeforeCounters, arrival_counters, count_done, gdc_launch_dependents, gdc_wait,
                     pdl_available, pdl_kw, prefetch_l2)
from .flash_attn import LOG2E, dot_precision, finite_max, kv_descriptors, load_kv, rms_norm_rows
from .tuning import DECODE_PREFETCH_SLOTS, LONG_CONTEXT, LONGER_CONTEXT, MANY_QUERY_ROWS, MANY_ROWS_SPLIT


@triton.jit
def _combine_head(ACC, M, L, O, h, so_h, E, n_splits, BLOCK_S: tl.constexpr, BLOCK_E: tl.constexpr):
    """Combine head h's n_splits partials (rows h·n_splits + s) into O[h]. Loads bypass L1 (.cg): in the fused
    path they read what other programs wrote during this launch."""
    offs_s = tl.arange(0, BLOCK_S)
    s_ok = offs_s < n_splits
    offs_e = tl.arange(0, BLOCK_E)
    e_ok = offs_e < E
    m = tl.load(M + h * n_splits + offs_s, mask=s_ok, other=float("-inf"), cache_modifier=".cg")  # [splits]
    l = tl.load(L + h * n_splits + offs_s, mask=s_ok, other=0.0, cache_modifier=".cg")
    acc = tl.load(ACC + (h * n_splits + offs_s)[:, None] * E + offs_e[None, :], mask=s_ok[:, None] & e_ok[None, :],
                  other=0.0, cache_modifier=".cg")  # [splits, E]
    w = tl.exp2(m - tl.max(m, axis=0))  # a split holds a seen key: the max is finite; empty splits weigh 0
    out = tl.sum(w[:, None] * acc, axis=0) / tl.sum(w * l, axis=0)
    tl.store(O + h * so_h + offs_e, out.to(O.dtype.element_ty), mask=e_ok)


@triton.jit
def _combine_heads(ACC, M, L, O, h0, n_heads, so_h, E, n_splits, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr,
                   BLOCK_E: tl.constexpr):
    """_combine_head for heads h0..h0+n_heads-1 at once: one round of loads instead of one per head (the fused
    path's last program would otherwise wait out n_heads load latencies in a row)."""
    offs_h = tl.arange(0, BLOCK_H)
    h_ok = offs_h < n_heads
    offs_s = tl.arange(0, BLOCK_S)
    offs_e = tl.arange(0, BLOCK_E)
    e_ok = offs_e < E
    rows = (h0 + offs_h)[:, None] * n_splits + offs_s[None, :]  # [Hb, S]
    ok = h_ok[:, None] & (offs_s < n_splits)[None, :]
    m = tl.load(M + rows, mask=ok, other=float("-inf"), cache_modifier=".cg")  # [Hb, S]
    l = tl.load(L + rows, mask=ok, other=0.0, cache_modifier=".cg")
    acc = tl.load(ACC + rows[:, :, None] * E + offs_e[None, None, :], mask=ok[:, :, None] & e_ok[None, None, :],
                  other=0.0, cache_modifier=".cg")  # [Hb, S, E]
    m_max = tl.where(h_ok, tl.max(m, axis=1), 0.0)  # padding heads: 0, not -inf (no NaN from -inf - -inf)
    w = tl.exp2(m - m_max[:, None])  # [Hb, S]
    out = tl.sum(w[:, :, None] * acc, axis=1) / tl.sum(w * l, axis=1)[:, None]  # [Hb, E]
    tl.store(O + (h0 + offs_h)[:, None] * so_h + offs_e[None, :], out.to(O.dtype.element_ty),
             mask=h_ok[:, None] & e_ok[None, :])


@triton.jit
def _attend(acc, m_i, l_i, q, CK, CV, DK, DV, VIS, kh, n0, end, offs_n, offs_e, e_ok, sk_s, sv_s, qk_scale,
            MASKED: tl.constexpr, EVEN_E: tl.constexpr, USE_DESC: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_E: tl.constexpr, DOT_PRECISION: tl.constexpr, CROSS: tl.constexpr):
    """One block of keys n0..n0+N into the running (acc, m, l); MASKED: the block reaches past `end`;
    CROSS: key n is seen only where VIS[n] != 0."""
    k, v = load_kv(CK, CV, DK, DV, kh, n0, offs_n, offs_e, e_ok, end, sk_s, sv_s, MASKED, EVEN_E, USE_DESC,
                   BLOCK_N, BLOCK_E)  # [N, E] each
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [G, E] @ [E, N] -> [G, N], raw scores
    if CROSS:
        if MASKED:
            seen = tl.load(VIS + n0 + offs_n, mask=n0 + offs_n < end, other=0) != 0
        else:
            seen = tl.load(VIS + n0 + offs_n) != 0
        s = tl.where(seen[None, :], s, float("-inf"))
    elif MASKED:
        s = tl.where(((n0 + offs_n) < end)[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)  # log2 domain
    m_use = finite_max(m_new, CROSS)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s * qk_scale - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)  # += [G, N] @ [N, E]
    return acc, m_new, l_i


@triton.jit
def _decode_split_kernel(Q, CK, CV, DK, DV, POS, VIS, QNW, ACC, M, L, O, CNT, sq_h, sk_k, sk_s, sv_k, sv_s, so_h,
                         E: tl.constexpr, G, split_len, n_splits, qk_scale, n_keys, eps, BLOCK_G: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr, FUSED: tl.constexpr,
                         BLOCK_HG: tl.constexpr, USE_DESC: tl.constexpr, DOT_PRECISION: tl.constexpr,
                         CROSS: tl.constexpr, QNORM: tl.constexpr, PDL: tl.constexpr = False,
                         PREFETCH: tl.constexpr = 0, LATE_Q: tl.constexpr = False):
    """Program (kv head kh, split): the split's partials; FUSED: the program drawing the kv head's last ticket
    combines its splits.
    CROSS: the query over all n_keys keys (no position), key n seen where VIS[n] != 0, and with QNORM the
    query RMSNorm'd per head by QNW first (Mllama's q_norm); else over the cache slots 0..POS.
    PDL: launched as a programmatic dependent; only the position read and the L2 prefetch of the split's first
    PREFETCH slots come before the wait for the previous kernel (module docstring).
    LATE_Q (not with QNORM): q is loaded in the first loop iteration, after the pipeline has issued its first
    K/V load, so their round trips overlap (loaded before the loop, q is stored to shared memory in its dot
    layout before that first load is issued, which then waits for q)."""
    kh = tl.program_id(0)
    split = tl.program_id(1)
    if PDL:
        gdc_launch_dependents()  # a PDL-launched successor waits for our completion itself
    if CROSS:
        ctx = n_keys
    else:
        ctx = tl.load(POS).to(tl.int32) + 1  # slots 0..pos hold this sequence (the new token's k/v included)
    start = split * split_len
    end = tl.minimum(start + split_len, ctx)
    if PREFETCH > 0:
        slots = tl.minimum(start + tl.arange(0, PREFETCH), tl.maximum(end - 1, start))  # clamped: no mask in asm
        prefetch_l2(CK + kh * sk_k + slots * sk_s)
        prefetch_l2(CV + kh * sv_k + slots * sv_s)
    if PDL:
        gdc_wait()  # q, the cache slot of this token, the partial buffers and the counters: after this
    full_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N  # blocks [start, full_end) need no mask
    offs_g = tl.arange(0, BLOCK_G)
    g_ok = offs_g < G
    heads = kh * G + offs_g  # the query heads that read kv head kh
    offs_n = tl.arange(0, BLOCK_N)
    offs_e = tl.arange(0, BLOCK_E)
    e_ok = offs_e < E
    # [G, E], padded to 16 rows for tl.dot; padding rows are zeros and never stored
    q_ptrs = Q + heads[:, None] * sq_h + offs_e[None, :]
    q_ok = g_ok[:, None] & e_ok[None, :]
    if LATE_Q:
        q = tl.zeros([BLOCK_G, BLOCK_E], Q.dtype.element_ty)  # loaded by the first iteration of either loop
    else:
        q = tl.load(q_ptrs, mask=q_ok, other=0.0)
    if QNORM:
        q = rms_norm_rows(q, QNW, offs_e, e_ok, E, eps)
    CK = CK + kh * sk_k
    CV = CV + kh * sv_k

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_E], tl.float32)
    # whole blocks inside the context, then at most one partial block; both loops are empty past the context
    for n0 in range(start, full_end, BLOCK_N):
        if LATE_Q:
            if n0 == start:
                q = tl.load(q_ptrs, mask=q_ok, other=0.0)
        acc, m_i, l_i = _attend(acc, m_i, l_i, q, CK, CV, DK, DV, VIS, kh, n0, end, offs_n, offs_e, e_ok, sk_s,
                                sv_s, qk_scale, False, BLOCK_E == E, USE_DESC, BLOCK_N, BLOCK_E, DOT_PRECISION, CROSS)
    for n0 in range(full_end, end, BLOCK_N):
        if LATE_Q:
            if n0 == start:  # the split's only block
                q = tl.load(q_ptrs, mask=q_ok, other=0.0)
        acc, m_i, l_i = _attend(acc, m_i, l_i, q, CK, CV, DK, DV, VIS, kh, n0, end, offs_n, offs_e, e_ok, sk_s,
                                sv_s, qk_scale, True, BLOCK_E == E, USE_DESC, BLOCK_N, BLOCK_E, DOT_PRECISION, CROSS)
    row = heads * n_splits + split  # partials laid out [H, splits, (E)]
    tl.store(M + row, m_i, mask=g_ok)
    tl.store(L + row, l_i, mask=g_ok)
    tl.store(ACC + row[:, None] * E + offs_e[None, :], acc, mask=g_ok[:, None] & e_ok[None, :])
    if FUSED:
        # The CTA barrier in count_done orders every thread's partial stores before its one release-add (a scalar
        # atomic: one thread), so the program that draws the last ticket has acquired all the partials; its reads
        # bypass L1. (A per-thread add on a [threads] tensor was slower: 128 adds on one address per program
        # serialize in L2.)
        if count_done(CNT + kh) == n_splits - 1:
            _combine_heads(ACC, M, L, O, kh * G, G, so_h, E, n_splits, BLOCK_HG, BLOCK_S, BLOCK_E)
            tl.store(CNT + kh, 0)  # every other program of this kv head is done: ready for the next launch


@triton.jit
def _decode_reduce_kernel(ACC, M, L, O, so_h, E, n_splits, BLOCK_S: tl.constexpr, BLOCK_E: tl.constexpr):
    _combine_head(ACC, M, L, O, tl.program_id(0), so_h, E, n_splits, BLOCK_S, BLOCK_E)


def _counters(device: torch.device, n: int) -> torch.Tensor | None:
    """The fused path's per-kv-head arrival counters: common.arrival_counters' first n. None while a CUDA graph
    is being captured and they do not exist yet (then the combine runs as its own kernel): the engine warms up
    before capturing, so this is only a guard."""
    try:
        return arrival_counters(device, n)[:n]
    except CaptureBeforeCounters:
        return None


def default_split_len(max_len: int, block_n: int = 64) -> int:
    """16 splits below LONG_CONTEXT slots, 32 from there on (8 kv heads: 128 or 256 programs, one or two per SM),
    whole blocks each, the fastest in an attention sweep (full caches, H=32 K=8 E=64; docs/performance.md):
    every program pays a fixed start (position, q, pipeline prologue) and the combine reads every split's
    partials, so more splits lost at every length below that."""
    per_split = triton.cdiv(max_len, 16 if max_len < LONG_CONTEXT else 32)
    return max(block_n, triton.cdiv(per_split, block_n) * block_n)


def _config(on_gpu: bool, split_len: int | None, dtype: torch.dtype, E: int, max_len: int) -> dict:
    """Same sweeps: 128-slot blocks where the split allows, 4 warps (8 was slower), 3 stages (4: within noise);
    the fused combine (one launch fewer than the second kernel). Long caches: K/V through TMA descriptors in
    256-slot blocks, 2 stages (E <= 64; 256 × 128 blocks would need 256 KB of shared memory: 128-slot, 3 stages).
    From LONGER_CONTEXT slots at E <= 64: 128-slot blocks, 3 stages (two buffers: a program loads the next block
    while it computes one; the 256-slot blocks' two stages are one buffer) and LATE_Q, the fastest as the decode
    step runs it at 32k (docs/performance.md, at); at 8k the 256-slot blocks stay faster.
    fp32 keeps 64-slot blocks: two 128×128 fp32 K/V stages need 272 KB of shared memory (> 227 KB, seen at E=128)."""
    if not on_gpu:
        return dict(BLOCK_N=16, num_warps=4, num_stages=3, FUSED=True)
    if dtype != torch.float32 and max_len >= LONG_CONTEXT:
        wide = E <= 64
        if wide and max_len >= LONGER_CONTEXT:
            return dict(BLOCK_N=128, num_warps=4, num_stages=3, FUSED=True, USE_DESC=True, LATE_Q=True)
        return dict(BLOCK_N=256 if wide else 128, num_warps=4, num_stages=2 if wide else 3, FUSED=True,
                    USE_DESC=True)
    wide = dtype != torch.float32 and (split_len is None or split_len >= 128)
    return dict(BLOCK_N=128 if wide else 64, num_warps=4, num_stages=3, FUSED=True)


def decode_attention_fwd(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, position: torch.Tensor,
                         out: torch.Tensor | None = None, max_len: int | None = None,
                         split_len: int | None = None, config: dict | None = None, pdl: bool = False) -> torch.Tensor:
    """q [1, H, E] (or [H, E]; rotated, head rows contiguous), cache_k/cache_v [K, S, E] holding slots 0..pos,
    position [1] int (device): the new token's position -> out shaped like q, in q's dtype.

    The grid covers `max_len` slots (default S, the capacity) in splits of `split_len` (a multiple of 16;
    default `default_split_len(max_len)`); the actual length pos + 1 is read on the device. `config` overrides
    BLOCK_N, num_warps, num_stages, FUSED (combine in the split kernel), USE_DESC (K/V through TMA
    descriptors where the cache allows them), PREFETCH (slots a split prefetches into L2 before the PDL wait, a
    power of 2), LATE_Q (q loaded in the first loop iteration): for tuning sweeps. `pdl`: launch as a
    programmatic dependent of the previous kernel on sm_90+, for caches of LONG_CONTEXT slots or more (config
    PDL=True forces it); the caller promises that kernel does not write `position` (module docstring).
    """
    assert position.numel() == 1
    max_len = cache_k.shape[1] if max_len is None else max_len
    cfg = {**_config(q.is_cuda, split_len, q.dtype, q.shape[-1], max_len), **(config or {})}
    if split_len is None:
        long = q.is_cuda and max_len >= LONG_CONTEXT  # whole blocks a split: 8k -> 32 × 256, 32k -> 32 × 1024
        split_len = default_split_len(max_len, cfg["BLOCK_N"] if long else 64 if q.is_cuda else 16)
        cfg["BLOCK_N"] = cfg["BLOCK_N"] if split_len % cfg["BLOCK_N"] == 0 else 64
    cfg = {"PDL": pdl and max_len >= LONG_CONTEXT, **cfg}  # shorter caches lost with PDL
    return _launch(q, cache_k, cache_v, position, None, None, 0.0, max_len, split_len, out, cfg)


def cross_decode_attention_fwd(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor,
                               norm_weight: torch.Tensor | None, eps: float, out: torch.Tensor | None = None,
                               split_len: int | None = None, config: dict | None = None) -> torch.Tensor:
    """Mllama's decode-step cross-attention: q [1, H, E] (before q_norm; head rows contiguous) RMSNorm'd per head by
    norm_weight [E] (None: no norm), over all N keys/values [K, N, E] (any strides but the last), key n seen where
    visible[n] != 0 (bool or integers [N], at least one set) -> out shaped like q. GPU default: splits of 256 keys in
    64-key blocks, 2 stages, the fastest at 11B-Vision's 6404 image tokens, E = 128 (docs/performance.md); with
    more than MANY_QUERY_ROWS query heads a kv head, splits of MANY_ROWS_SPLIT keys and the separate combine kernel
    (the vision encoder's padding rows, 28 a head: the fused combine would hold [rows, splits, E] partials in one
    program's registers; not under the CPU interpreter, where those programs cost more than the default)."""
    N = keys.shape[1]
    assert visible.numel() == N and visible.reshape(-1).stride(0) == 1
    assert norm_weight is None or norm_weight.shape == (q.shape[-1],)
    many = q.is_cuda and q.shape[-2] // keys.shape[0] > MANY_QUERY_ROWS
    if split_len is None:
        cpu_split = max(16, triton.cdiv(triton.cdiv(N, 8), 16) * 16)
        split_len = (MANY_ROWS_SPLIT if many else 256) if q.is_cuda else cpu_split
    tuned = {"BLOCK_N": 64, "num_stages": 2, **({"FUSED": False} if many else {})} if q.is_cuda else {}
    cfg = {**_config(q.is_cuda, split_len, q.dtype, q.shape[-1], 0), **tuned, **(config or {})}  # 0: not long
    vis = visible.reshape(-1)
    vis = vis.view(torch.uint8) if vis.dtype == torch.bool else vis
    return _launch(q, keys, values, None, vis, norm_weight, eps, N, split_len, out, cfg)


def _launch(q, cache_k, cache_v, position, visible, norm_weight, eps, max_len, split_len, out, cfg):
    """The split kernel (+ the combine kernel unless FUSED) over max_len keys; visible None: causal by position."""
    H, E = q.shape[-2:]
    NK = cache_k.shape[0]
    assert H % NK == 0 and E <= 128 and q.stride(-1) == 1 and cache_k.stride(2) == 1 and cache_v.stride(2) == 1
    cfg = dict(cfg)
    cfg["BLOCK_N"] = min(cfg["BLOCK_N"], split_len)
    assert split_len % cfg["BLOCK_N"] == 0 and cfg["BLOCK_N"] >= 16, "split_len must be a multiple of 16"
    cnt = _counters(q.device, NK) if cfg["FUSED"] else None
    n_splits = triton.cdiv(max_len, split_len)
    G = H // NK
    acc = torch.empty((H, n_splits, E), dtype=torch.float32, device=q.device)
    m = torch.empty((H, n_splits), dtype=torch.float32, device=q.device)
    l = torch.empty((H, n_splits), dtype=torch.float32, device=q.device)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    block_e = max(16, triton.next_power_of_2(E))
    block_s = triton.next_power_of_2(n_splits)
    use_desc = cfg.pop("USE_DESC", False)
    on_gpu = pdl_available(q)  # the PDL and prefetch parts are inline asm: GPU only
    pdl = bool(cfg.pop("PDL", False)) and on_gpu
    prefetch = cfg.pop("PREFETCH", DECODE_PREFETCH_SLOTS if pdl else 0)  # popped always: not a kernel argument
    prefetch = prefetch if on_gpu else 0
    late_q = bool(cfg.pop("LATE_Q", False)) and norm_weight is None
    descs = kv_descriptors(cache_k, cache_v, cfg["BLOCK_N"], block_e, use_desc)
    dk, dv = descs if descs else (cache_k, cache_v)  # unused placeholders on the pointer path
    cross = visible is not None
    args = (q, cache_k, cache_v, dk, dv, position if not cross else visible, visible if cross else q,
            q if norm_weight is None else norm_weight, acc, m, l, out, m if cnt is None else cnt, q.stride(-2),
            cache_k.stride(0), cache_k.stride(1), cache_v.stride(0), cache_v.stride(1), out.stride(-2), E, G,
            split_len, n_splits, LOG2E / math.sqrt(E), max_len, float(eps))
    kw = dict(BLOCK_G=max(16, triton.next_power_of_2(G)), BLOCK_E=block_e, BLOCK_S=block_s,
              BLOCK_HG=triton.next_power_of_2(G), USE_DESC=descs is not None, DOT_PRECISION=dot_precision(q.dtype),
              CROSS=cross, QNORM=norm_weight is not None, PDL=pdl,
              PREFETCH=min(prefetch, 1 << (split_len.bit_length() - 1)),  # a power of 2 within the split
              LATE_Q=late_q,
              **{**cfg, "FUSED": cnt is not None}, **pdl_kw(pdl))
    _decode_split_kernel[(NK, n_splits)](*args, **kw)
    if cnt is None:
        _decode_reduce_kernel[(H,)](acc, m, l, out, out.stride(-2), E, n_splits, BLOCK_S=block_s, BLOCK_E=block_e,
                                    num_warps=4)
    return out
