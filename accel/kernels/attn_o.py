"""Decode attention and the o projection in ONE launch: x += W_o @ attention(q, cache), for one new token.

Why: at batch 1 the decode attention is latency-bound (a few dependent round trips over a short cache, ~4 µs a
layer) and leaves the HBM idle, and the o GEMV that follows pays its own launch and the ramp of its first weight
loads (nvidia-h200, 2026-11-21, accel/NOTES.md v6). Here the first n_attn programs are decode_attn's split
programs (the last of each kv head combines its heads, then counts the head done), and the others are the o
GEMV's row blocks: each issues its weight tile [BLOCK_N, K] first — it does not depend on the attention —, then
waits until all kv heads are counted, reads the attention output and finishes its rows with the residual add.
So the o weights stream while the attention runs.

Forward progress: a waiting o program holds an SM slot. The attention work never waits, and its programs have the
lowest ids, which the hardware dispatches first; still, nothing in CUDA promises that order, so each attention
work item is CLAIMED with an atomic exchange: its own program claims it at start (the claim's latency overlaps
the item's loads), and an o program that has waited `steal_after` polls claims every item still unclaimed and
does it itself. Whichever way the items run, the results are the same bits (one item's code, one combine order).

Counters (int32, zeros between launches): DONE[0] kv heads combined, DONE[1] programs finished, then one claim
flag per attention item. The last program to finish re-arms them all for the next launch.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import decode_attn
from .decode_attn import split_item
from .flash_attn import LOG2E
from .gemv import _epilogue, _sm_count, _tile, gemv_config


@triton.jit
def _item(t, Q, CK, CV, POS, ACC, M, L, A, CNT, DONE, sq_h, sk_k, sk_s, sv_k, sv_s, E: tl.constexpr, G, split_len,
          n_splits, qk_scale, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr,
          BLOCK_S: tl.constexpr, BLOCK_HG: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Attention item t (kv head t // splits, split t % splits); the kv head's last item counts it done."""
    last = split_item(t // n_splits, t % n_splits, Q, CK, CV, POS, ACC, M, L, A, CNT, sq_h, sk_k, sk_s, sv_k, sv_s,
                      E, E, G, split_len, n_splits, qk_scale, BLOCK_G, BLOCK_N, BLOCK_E, BLOCK_S, True, BLOCK_HG,
                      DOT_PRECISION)
    if last:  # the combine's stores (all threads) before the one release-add
        tl.debug_barrier()
        tl.atomic_add(DONE, 1, sem="release", scope="gpu")


@triton.jit
def _poll(DONE, SPIN: tl.constexpr):
    """DONE[0], read with acquire semantics: an atomic (SPIN 0) or a plain ld.acquire (SPIN 1: no trip through the
    L2's atomic unit, where hundreds of waiting programs would queue in front of the attention's counting)."""
    if SPIN == 0:
        return tl.atomic_add(DONE, 0, sem="acquire", scope="gpu")
    else:
        return tl.inline_asm_elementwise("ld.global.acquire.gpu.b32 $0, [$1];", "=r,l", [DONE], dtype=tl.int32,
                                         is_pure=False, pack=1)


@triton.jit
def _attn_o_kernel(Q, CK, CV, POS, ACC, M, L, A, CNT, DONE, W, X, N, K, stride_w, sq_h, sk_k, sk_s, sv_k, sv_s,
                   E: tl.constexpr, G, NKV, split_len, n_splits, qk_scale, n_o, steal_after,
                   BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr,
                   BLOCK_HG: tl.constexpr, DOT_PRECISION: tl.constexpr, O_ROWS: tl.constexpr, O_K: tl.constexpr,
                   EVEN_K: tl.constexpr, SKIP_OWN: tl.constexpr, SPIN: tl.constexpr,
                   LOAD_FIRST: tl.constexpr):
    pid = tl.program_id(0)
    n_attn = NKV * n_splits
    CLAIM = DONE + 2
    if pid < n_attn:
        if not SKIP_OWN:  # (tests: leave every item to the stealing o programs)
            if tl.atomic_xchg(CLAIM + pid, 1, sem="relaxed", scope="gpu") == 0:
                _item(pid, Q, CK, CV, POS, ACC, M, L, A, CNT, DONE, sq_h, sk_k, sk_s, sv_k, sv_s, E, G, split_len,
                      n_splits, qk_scale, BLOCK_G, BLOCK_N, BLOCK_E, BLOCK_S, BLOCK_HG, DOT_PRECISION)
    else:
        b = pid - n_attn
        rows = b * O_ROWS + tl.arange(0, O_ROWS)
        rows_c = tl.minimum(rows, N - 1).to(tl.int64)
        cols = tl.arange(0, O_K)
        if LOAD_FIRST:
            w = _tile(W, rows_c, stride_w, 0, cols, K, EVEN_K)  # [O_ROWS, O_K]: issued before the wait
        done = _poll(DONE, SPIN)
        polls = 0
        while (done < NKV) & (polls < steal_after):
            polls += 1
            done = _poll(DONE, SPIN)
        if done < NKV:  # the attention programs may not be running: do every item still unclaimed, then wait
            for t in range(0, n_attn):
                if tl.atomic_xchg(CLAIM + t, 1, sem="relaxed", scope="gpu") == 0:
                    _item(t, Q, CK, CV, POS, ACC, M, L, A, CNT, DONE, sq_h, sk_k, sk_s, sv_k, sv_s, E, G,
                          split_len, n_splits, qk_scale, BLOCK_G, BLOCK_N, BLOCK_E, BLOCK_S, BLOCK_HG,
                          DOT_PRECISION)
            done = _poll(DONE, SPIN)
            while done < NKV:
                done = _poll(DONE, SPIN)
            if LOAD_FIRST:
                w = _tile(W, rows_c, stride_w, 0, cols, K, EVEN_K)  # again: not held in registers through the items
        if not LOAD_FIRST:
            w = _tile(W, rows_c, stride_w, 0, cols, K, EVEN_K)
        a = tl.load(A + cols, mask=cols < K, other=0.0, cache_modifier=".cg").to(tl.float32)  # written this launch
        y = tl.sum(w.to(tl.float32) * a[None, :], axis=1)  # [O_ROWS]
        _epilogue(y, X, X, rows, N, True)
    # every program counts itself out after its claim (and o programs after their wait); the last one re-arms
    # the counters for the next launch: no claim or wait of this launch can follow it
    if tl.atomic_add(DONE + 1, 1, sem="acq_rel", scope="gpu") == n_attn + n_o - 1:
        tl.store(DONE + tl.arange(0, 2), tl.zeros([2], tl.int32))
        for t in range(0, n_attn):
            tl.store(CLAIM + t, 0)


_DONE: dict[torch.device, torch.Tensor] = {}


def _done(device: torch.device, n: int) -> torch.Tensor:
    buf = _DONE.get(device)
    if buf is None or buf.numel() < n:
        assert not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()), \
            "attn_o's counters must exist before a CUDA graph capture (run one step first)"
        buf = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
        _DONE[device] = buf
    return buf


def attn_o_fwd(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, position: torch.Tensor,
               o_weight: torch.Tensor, x: torch.Tensor, max_len: int | None = None, rows: int | None = None,
               warps: int | None = None, block_n: int | None = None, maxnreg: int | None = None,
               steal_after: int = 4096, skip_own: bool = False, spin: int = 0, load_first: bool = True) -> torch.Tensor:
    """x [1, D] += o_weight [D, H·E] @ attention(q [1, H, E] over slots 0..position of cache_k/cache_v [K, S, E]),
    in place, with decode_attention_fwd's and gemv_fwd's roundings. rows/warps/stages: o rows a program, warps,
    the attention's key block, the register cap (sweeps); steal_after: polls (~1 µs each) before a waiting o
    program does unclaimed attention items itself; skip_own (tests) leaves them all to that path."""
    H, E = q.shape[-2:]
    NK = cache_k.shape[0]
    N, K = o_weight.shape
    assert K == H * E and x.numel() == N and x.is_contiguous() and o_weight.stride(1) == 1
    assert H % NK == 0 and E <= 128 and q.stride(-1) == 1 and cache_k.stride(2) == 1 and cache_v.stride(2) == 1
    gemv = gemv_config(N, K, _sm_count(o_weight.device), o_weight.element_size())
    config = {"FUSED": True} if block_n is None else {"FUSED": True, "BLOCK_N": block_n}
    pl = decode_attn.plan(q, cache_k, max_len, None, config)
    assert pl.cnt is not None, "attn_o's attention counters must exist before a CUDA graph capture"
    meta = {k: v for k, v in pl.meta.items() if k != "FUSED"}
    meta["num_warps"] = warps or (gemv.warps if q.is_cuda else 4)
    if maxnreg and q.is_cuda:
        meta["maxnreg"] = maxnreg
    o_rows = rows or gemv.block_n
    n_o = triton.cdiv(N, o_rows)
    n_attn = NK * pl.n_splits
    done = _done(q.device, 2 + n_attn)
    a = torch.empty((H, E), dtype=q.dtype, device=q.device)
    o_k = triton.next_power_of_2(K)
    _attn_o_kernel[(n_attn + n_o,)](
        q, cache_k, cache_v, position, pl.acc, pl.m, pl.l, a, pl.cnt, done, o_weight, x, N, K, o_weight.stride(0),
        q.stride(-2), cache_k.stride(0), cache_k.stride(1), cache_v.stride(0), cache_v.stride(1), E, H // NK, NK,
        pl.split_len, pl.n_splits, LOG2E / math.sqrt(E), n_o, steal_after, O_ROWS=o_rows, O_K=o_k,
        EVEN_K=o_k == K, SKIP_OWN=skip_own, SPIN=spin if q.is_cuda else 0, LOAD_FIRST=load_first, **meta)
    return x
