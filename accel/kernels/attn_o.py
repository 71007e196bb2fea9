"""The decode step's attention, o projection and residual add in ONE launch: x += o(attention(q, cache)).

Work is handed out by ticket (accel/kernels/chain.py). Tickets 0..A-1 (A = K kv heads × splits) are the decode
attention's split programs exactly as accel/kernels/decode_attn.py runs them (`split_program`, the fused combine
included): the program that combines a kv head's splits stores that head group's output, then counts one kv head
done. The later tickets are o's (row block, K slice) programs: each first fetches its weights — the quantized
codes of its slice into L2 (qgemv.py's `_pdl_start`), the dense tile straight into registers — since the weights
do not depend on the attention, then waits until all K kv heads are combined, then multiplies its rows with the
GEMV's own body (qgemv.py's `_qdot`, gemv.py's `_dot_tile`) and adds the residual in the same epilogue (split-K
slices summed in slice order by the row block's last program, common.split_k_epilogue). The same sums in the same
order as the two launches with the same o config, so the results are the same bits. The counters go back to 0
without a count at the end of the launch: the program that draws the last ticket zeroes the tickets, the last o
program past its wait zeroes the kv heads' count and the count of those past it, the combining programs their
kv head's split count. Why: at batch 1 every kernel pays 1.5-3 µs of ramp and tail beyond its bytes; here o's
weight fetch overlaps the attention, and one of the layer's five boundaries goes.

One kernel has one set of launch options: o's programs run with the attention's warps, stages and shared memory;
o's tiles and split come from `attn_o_config` (tuning.ATTN_O, else o's own GEMV row without persistence).
After the wait, o reads the attention output with plain loads: the acquire of `chain.wait_count` (its result
broadcast through a CTA barrier) orders them after the combining programs' release, and nothing on the SM read
those lines earlier in the launch.

PDL: the launch is a programmatic dependent exactly when the attention alone would be (decode_attn.self_config:
caches of LONG_CONTEXT slots or more), both phases waiting (`gdc_wait`) before touching what the previous kernel
writes (q, the cache slot, the residual x); o's weight fetch comes before it. The next kernel (the MLP's gate_up
GEMV, which reads x) is let launch per o's quantized PdlMode (qgemv.PDL_DEFAULT: after the wait or after the main
loop); it waits for this whole launch before reading x. The chain counters are COUNTER_BASE.. of
chain.chain_counters: a neighbour taking tickets from other counters may overlap this launch.
"""
from __future__ import annotations

import contextvars
import torch
import triton
import triton.language as tl

from . import chain, tuning
from .common import (gdc_launch_dependents, gdc_wait, per_row_scales, row_tile, setting, sm_count, split_k_epilogue,
                     split_scratch)
from .decode_attn import self_config, split_launch, split_program
from .gemv import _dot_tile
from .qgemv import (PDL_DEFAULT, PdlMode, _fast, _launch_checks, _pdl_kwargs, _pdl_start, _qdot, k_slices,
                    qgemv_config)
from .tuning import QGemvConfig

# chain counters from COUNTER_BASE, each on its own 128-byte line (the o programs' spin on one must not slow the
# attention's atomics on another): +0 tickets, +32 kv heads combined, +64 o programs past the wait, +96.. the
# kv heads' split arrivals (decode_attn's fused combine)
COUNTER_BASE = 128


@triton.jit
def _attn_o_kernel(Q, CK, CV, DK, DV, POS, VIS, QNW, ACC, M, L, O, CNT, sq_h, sk_k, sk_s, sv_k, sv_s, so_h,
                   E: tl.constexpr, G, split_len, n_splits, qk_scale, n_keys, eps,
                   NKV, W, SC, MN, R, P, PCNT, CHAIN, N, KO, KB, stride_w, stride_s, n_groups, kb_split, n_o,
                   BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr,
                   FUSED: tl.constexpr, BLOCK_HG: tl.constexpr, USE_DESC: tl.constexpr, DOT_PRECISION: tl.constexpr,
                   CROSS: tl.constexpr, QNORM: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr,
                   LATE_Q: tl.constexpr, DENSE: tl.constexpr, BITS: tl.constexpr, OFFSET: tl.constexpr,
                   GROUP: tl.constexpr,
                   HAS_MIN: tl.constexpr, PER_ROW: tl.constexpr, OBLOCK_N: tl.constexpr, OBLOCK_K: tl.constexpr,
                   OSTAGES: tl.constexpr, SPLIT_K: tl.constexpr, FAST: tl.constexpr, EVEN_K: tl.constexpr,
                   TRIGGER: tl.constexpr, PF_LINES: tl.constexpr):
    """Ticket t < NKV·n_splits: the attention's (kv head t // n_splits, split t % n_splits). Else o's row block
    u // SPLIT_K, K slice u % SPLIT_K (u = t − NKV·n_splits): byte columns kb_split a slice of the codes W
    (quantized: scales SC, minima MN, qgemv.py's layout), or columns OBLOCK_K of the dense W; R += o(O) in place."""
    t = chain.take_ticket(CHAIN)
    if t == NKV * n_splits + n_o - 1:  # the last ticket: every program has taken its own
        chain.reset(CHAIN, 1)
    if t < NKV * n_splits:
        if split_program(t // n_splits, t % n_splits, Q, CK, CV, DK, DV, POS, VIS, QNW, ACC, M, L, O, CNT, sq_h,
                         sk_k, sk_s, sv_k, sv_s, so_h, E, G, split_len, n_splits, qk_scale, n_keys, eps, BLOCK_G,
                         BLOCK_N, BLOCK_E, BLOCK_S, FUSED, BLOCK_HG, USE_DESC, DOT_PRECISION, CROSS, QNORM, PDL,
                         PREFETCH, LATE_Q):
            chain.count_done(CHAIN + 32)  # this kv head's output is stored
    else:
        u = t - NKV * n_splits
        b = u // SPLIT_K
        sp = u % SPLIT_K
        rows = b * OBLOCK_N + tl.arange(0, OBLOCK_N)
        rows_c = tl.minimum(rows, N - 1).to(tl.int64)  # rows past N re-read row N-1; the stores are masked
        kb_lo = sp * kb_split
        if DENSE:
            cols = tl.arange(0, OBLOCK_K)
            w = row_tile(W, rows_c, stride_w, kb_lo, cols, KO, EVEN_K)  # before any wait: weights are read-only
            if PDL:
                gdc_wait()
            chain.wait_count(CHAIN + 32, NKV)
            passed = chain.take_ticket(CHAIN + 64)  # o programs past the wait (used at the end: no stall here)
            acc = _dot_tile(w, O, O, kb_lo, cols, KO, 0.0, 0, EVEN_K)
        else:
            kb_hi = tl.minimum(kb_lo + kb_split, KB)
            _pdl_start(W, SC, MN, rows_c, kb_lo, kb_hi, stride_w, stride_s, BITS, GROUP, HAS_MIN, PDL, TRIGGER,
                       PF_LINES)
            chain.wait_count(CHAIN + 32, NKV)
            passed = chain.take_ticket(CHAIN + 64)  # o programs past the wait (used at the end: no stall here)
            acc = _qdot(W, SC, MN, O, O, rows_c, kb_lo, kb_hi, KO, KB, stride_w, stride_s, 0.0, n_groups, BITS,
                        OFFSET, GROUP, HAS_MIN, PER_ROW, 0, OBLOCK_N, OBLOCK_K, 1, OSTAGES, FAST)
            if TRIGGER == 2:
                gdc_launch_dependents()
        split_k_epilogue(acc, P, PCNT, R, R, rows, N, sp, b, SPLIT_K, True)
        if passed == n_o - 1:  # every o program is past its wait: nothing reads the kv heads' count again
            chain.reset(CHAIN + 32, 1)
            chain.reset(CHAIN + 64, 1)


def attn_o_config(N: int, K: int, bits: int, group: int, sms: int) -> QGemvConfig:
    """o's tiles inside the chained launch (its warps are the attention's: `warps` is not used): tuning.ATTN_O's row for
    (N, K, bits, group) on a GPU (bits 16: the dense weight, group 0), else o's own GEMV row (qgemv.qgemv_config)
    with a persistent row's tiles one program a row block; dense: one tile a program of the widest of 2048, 1024,
    512 columns that divides K, 8 rows, split-K over the tiles (on CPU: one tile of up to 1024 columns, 32 rows)."""
    if sms and (N, K, bits, group) in tuning.ATTN_O:
        return tuning.ATTN_O[(N, K, bits, group)]
    if bits == 16:
        if not sms:
            return QGemvConfig(min(32, triton.next_power_of_2(N)), min(1024, triton.next_power_of_2(K)), 4, 1, 1)
        bk = next((c for c in (2048, 1024, 512) if K % c == 0), min(2048, triton.next_power_of_2(K)))
        return QGemvConfig(8, bk, 4, triton.cdiv(K, bk), 1)
    return qgemv_config(N, K, bits, group, sms)._replace(programs=0)


def chain_counters(device: torch.device, kv_heads: int) -> torch.Tensor:
    """This launch's counters (module doc): a view of chain.chain_counters from COUNTER_BASE."""
    assert kv_heads <= 32, "kv heads past 32 would reach accel/kernels/qmlp.py's counters"
    return chain.chain_counters(device, COUNTER_BASE + 96 + kv_heads)[COUNTER_BASE:]


_CHAINED = contextvars.ContextVar("accel_kernels_attn_o_chained", default=False)


def chained_launch(on: bool):
    """Within this block, the decode step's attention + o (accel.ops.attention_o_add) runs as this one launch
    (True) or as the two launches (False: the default). For benchmarks and tests comparing them."""
    return setting(_CHAINED, on)


def chained() -> bool:
    """Whether the decode step runs attention + o as this one launch here: only inside chained_launch(True). It
    was slower than the two launches for bf16, int8 and int4:64 at 1B and 3B, short and 8192-slot caches
    (tools/bench/NOTES.md, "attention + o in one launch"): a measured option, not a default."""
    return _CHAINED.get()


def attention_o_fwd(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, position: torch.Tensor,
                    weight: torch.Tensor, residual: torch.Tensor, *, max_len: int | None = None,
                    split_len: int | None = None, config: dict | None = None, pdl: bool = False) -> torch.Tensor:
    """residual += weight @ decode_attention(q, cache_k, cache_v, position) in one launch, weight [D, H·E] dense
    (rows contiguous), residual [1, D] -> residual. q, the cache, position, max_len, split_len, config and pdl as
    decode_attn.decode_attention_fwd's; o's tiles are `attn_o_config`'s."""
    N, K = weight.shape
    assert weight.stride(1) == 1, "weight rows must be contiguous"
    cfg = attn_o_config(N, K, 16, 0, sm_count(weight.device))
    weights = (weight, weight, weight, K, weight.stride(0), 0, 0, cfg.block_k)  # W, SC, MN, KB, strides, groups, slice
    o = dict(DENSE=True, BITS=16, OFFSET=0, GROUP=0, HAS_MIN=False, PER_ROW=False, FAST=False,
             EVEN_K=K % cfg.block_k == 0, TRIGGER=0, PF_LINES=0)
    return _launch(q, cache_k, cache_v, position, residual, N, K, cfg, triton.cdiv(K, cfg.block_k), weights, o,
                   max_len, split_len, config, pdl)


def attention_o_qfwd(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, position: torch.Tensor,
                     codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor | None, bits: int, offset: int,
                     group: int, K: int, residual: torch.Tensor, *, max_len: int | None = None,
                     split_len: int | None = None, config: dict | None = None, pdl: bool = False,
                     o_pdl: PdlMode | None | str = "default") -> torch.Tensor:
    """attention_o_fwd for the quantized o [D, K = H·E] (qgemv.py's layout: codes, scale, low, bits, offset,
    group). o_pdl (a qgemv.PdlMode, None or "default": PDL_DEFAULT's) sets when the next kernel may launch; every
    o program prefetches all its codes into L2 before its wait (on the GPU), whatever the mode."""
    N = codes.shape[0]
    assert codes.stride(1) == 1 and scale.stride(1) == 1 and (low is None or low.stride() == scale.stride())
    per_row = per_row_scales(group, K, low)
    cfg = attn_o_config(N, K, bits, group, sm_count(codes.device))
    _launch_checks(cfg, bits, group, per_row, K)
    pack = 8 // bits
    k_split, split = k_slices(cfg, K)
    mode = PDL_DEFAULT.get(bits) if o_pdl == "default" else o_pdl
    trigger = "wait" if mode is None or mode.trigger == "none" else mode.trigger
    pk = _pdl_kwargs(PdlMode(trigger, k_split), codes, cfg, bits, k_split // pack, rope=False)  # {} off the GPU
    weights = (codes, scale, low if low is not None else scale, triton.cdiv(K, pack), codes.stride(0),
               scale.stride(0), scale.shape[1], k_split // pack)
    o = dict(DENSE=False, BITS=bits, OFFSET=offset, GROUP=group, HAS_MIN=low is not None, PER_ROW=per_row,
             FAST=_fast(codes, bits, K), EVEN_K=True, PF_LINES=pk.get("PF_LINES", 0),
             TRIGGER=pk.get("TRIGGER", 0) if mode is not None and mode.trigger != "none" else 0)
    return _launch(q, cache_k, cache_v, position, residual, N, K, cfg, split, weights, o, max_len, split_len, config,
                   pdl)


def _launch(q, cache_k, cache_v, position, residual, N, K, cfg, split, weights, o, max_len, split_len, config, pdl):
    """The attention's split programs (decode_attn.split_launch, fused combine), then o's row blocks × `split`
    slices; weights: o's (W, SC, MN, KB, stride_w, stride_s, n_groups, kb_split), o: its constexprs."""
    assert position.numel() == 1 and q.shape[-1] * q.shape[-2] == K
    assert residual.numel() == N and residual.reshape(-1).stride(0) == 1
    NK = cache_k.shape[0]
    max_len, split_len, acfg = self_config(q, cache_k, max_len, split_len, config, pdl)
    counters = chain_counters(q.device, NK)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # the attention output, contiguous: o's x
    grid, args, kw, _ = split_launch(q, cache_k, cache_v, position, None, None, 0.0, max_len, split_len, out, acfg,
                                     counters[96:])
    blocks = triton.cdiv(N, cfg.block_n)
    p, c = split_scratch(q.device, split * N, blocks) if split > 1 else (residual, residual)
    W, SC, MN, *sizes = weights
    _attn_o_kernel[(grid[0] * grid[1] + blocks * split,)](
        *args, NK, W, SC, MN, residual, p, c, counters, N, K, *sizes, blocks * split, **kw, **o,
        OBLOCK_N=cfg.block_n, OBLOCK_K=cfg.block_k, OSTAGES=cfg.stages, SPLIT_K=split)
    return residual
