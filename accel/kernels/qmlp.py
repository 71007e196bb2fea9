"""The quantized decode MLP as one launch: x += down(silu(gate)·up) with gate, up = gate_up(rms_norm(x)), gate_up's
and down's programs chained (accel/kernels/chain.py) instead of two kernels: one kernel's ramp and tail for the MLP,
and down's programs of a K slice start as soon as the gate_up blocks writing that slice of h are done.

Tickets 0 .. A-1 (A: gate_up's row-pair blocks) run accel/kernels/qgemv_fused.py's gate_up + SwiGLU block
(`gate_up_block`), store h [F] and count themselves done for the down K slice their columns fall in; the later
tickets are down's (row block, K slice) pairs, slice-major (qgemv.py's `_slice_block`): each first prefetches its
slice of the codes and its first scales into L2 (they do not depend on h; on the GPU), then waits for its slice's
gate_up blocks, reads h past L1 (PROLOGUE_CHAINED) and runs down's block with the residual epilogue (split-K: summed
by the row block's last slice, as qgemv_fwd). The same helpers, tiles and sums as the two kernels: equal to them
bit for bit where the launch's num_warps is theirs (the interpreter: always). The program counting the last down
block done returns the launch's counters to 0.

Measured slower than the two kernels at every config tried (tools/bench/NOTES.md, "decode MLP as one launch"): the
launch gives down's programs gate_up's registers and shared memory, so fewer fit an SM. So it runs only where
tuning.QMLP lists gate_up's shape (none) or accel.quant_ops.mlp_chained asks for it.

PDL (qgemv.py's module doc): every program waits (gdc_wait) before its first read of x or h and its first store; the
trigger (PdlMode "wait": after that wait, "late": after its main loop) is placed alike in both phases, so the next
kernel (the next layer's qkv) launches once every program has passed it, and itself waits for our end before it
reads x.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import chain, qgemv, tuning
from .common import PROLOGUE_CHAINED, pdl_available, per_row_scales, sm_count, split_scratch
from .qgemv import PdlMode, _fast, _launch_checks, _operands, _pdl_kwargs, _slice_block, k_slices
from .qgemv_fused import gate_up_block, gate_up_config, half_block
from .tuning import QGemvConfig, QMlpConfig

# Our counters in the device's chain buffer, from _CNT_AT: the ticket, the done counts of gate_up's blocks per down K
# slice (at 32 + slice: another 128-byte line than the ticket's) and of down's blocks (at 64). Apart from the
# buffer's start: a chained kernel launched just before ours (the attention + o) may still count there while our
# programs, PDL-launched, take their tickets.
_CNT_AT = 256
_CNT_N = 96
_CHAINED = tl.constexpr(PROLOGUE_CHAINED)


@triton.jit
def _mlp_kernel(GQ, GS, GM, X, NW, H, DQ, DS, DM, P, PCNT, CNT, F, D, GKB, DKB, g_stride_q, g_stride_s,
                d_stride_q, d_stride_s, eps, g_groups, d_groups, kb_split, k_cols, n_up, blocks, BITS: tl.constexpr,
                OFFSET: tl.constexpr, HAS_MIN: tl.constexpr, G_GROUP: tl.constexpr, G_PER_ROW: tl.constexpr,
                G_BLOCK_N: tl.constexpr, G_BLOCK_K: tl.constexpr, G_STAGES: tl.constexpr, G_FAST: tl.constexpr,
                D_POW2: tl.constexpr, D_GROUP: tl.constexpr, D_PER_ROW: tl.constexpr, D_BLOCK_N: tl.constexpr,
                D_BLOCK_K: tl.constexpr, D_STAGES: tl.constexpr, D_FAST: tl.constexpr, SPLIT_K: tl.constexpr,
                SPLIT_POW2: tl.constexpr, PDL: tl.constexpr = False, TRIGGER: tl.constexpr = 0,
                PF_LINES: tl.constexpr = 0, D_PF_LINES: tl.constexpr = 0):
    """Ticket t < n_up: gate_up + SwiGLU's row-pair block t -> H [t·HN, t·HN + HN), counted done for the down K
    slice (k_cols columns a slice) holding those columns. Else down's row block (t - n_up) % blocks over K slice
    (t - n_up) // blocks (slice-major: the first slices' h is the first written), once every gate_up block of its
    slice is done; its D_PF_LINES lines a row prefetched before that wait. G_* / D_*: each phase's constexprs
    (qgemv.py's); PDL, TRIGGER, PF_LINES: `_pdl_start`'s, the same in both phases (PF_LINES: gate_up's)."""
    HN: tl.constexpr = G_BLOCK_N // 2
    t = chain.take_ticket(CNT)
    if t < n_up:
        gate_up_block(GQ, GS, GM, X, NW, H, t, F, D, GKB, g_stride_q, g_stride_s, eps, g_groups, BITS, OFFSET,
                      G_GROUP, HAS_MIN, G_PER_ROW, G_BLOCK_N, G_BLOCK_K, D_POW2, G_STAGES, G_FAST, PDL, TRIGGER,
                      PF_LINES)
        chain.count_done(CNT + 32 + t * HN // k_cols)
    else:
        u = t - n_up
        sp = u // blocks
        n_done = (tl.minimum(k_cols, F - sp * k_cols) + HN - 1) // HN  # gate_up blocks writing this slice's h
        _slice_block(DQ, DS, DM, H, H, X, X, P, PCNT, u % blocks, sp, D, F, DKB, d_stride_q, d_stride_s, eps,
                     d_groups, kb_split, BITS, OFFSET, D_GROUP, HAS_MIN, D_PER_ROW, _CHAINED, True, D_BLOCK_N,
                     D_BLOCK_K, 1, SPLIT_K, D_STAGES, D_FAST, PDL, TRIGGER, D_PF_LINES, CNT + 32 + sp, n_done, True)
        if chain.count_done(CNT + 64) == blocks * SPLIT_K - 1:  # the launch's last work: the counters back to 0
            chain.reset(CNT, 1)
            chain.reset(CNT + 32, SPLIT_POW2)
            chain.reset(CNT + 64, 1)


def mlp_configs(N: int, D: int, F: int, bits: int, g_group: int, d_group: int, sms: int,
                launch: QMlpConfig | None = None) -> tuple[QGemvConfig, QGemvConfig, QMlpConfig]:
    """(gate_up's config, down's, the launch's) by default: `launch` (else tuning.QMLP's row for gate_up, else
    gate_up's warps); gate_up's tiles as its own kernel's (qgemv_fused.gate_up_config), down's the launch's or as
    its own kernel's (qgemv.qgemv_config), both unpersisted (one ticket a block)."""
    g = gate_up_config(N, D, bits, g_group, sms)._replace(programs=0)
    launch = launch or tuning.QMLP.get((N, D, bits, g_group)) or QMlpConfig(g.warps)
    d = QGemvConfig(*launch.down) if launch.down else qgemv.qgemv_config(D, F, bits, d_group, sms)
    return g, d._replace(programs=0), launch


def norm_mlp_qfwd(gate_up: tuple, down: tuple, bits: int, offset: int, x: torch.Tensor, norm_weight: torch.Tensor,
                  eps: float, config: tuple | None = None, pdl: PdlMode | None | str = "default") -> torch.Tensor:
    """x += down(swiglu(gate_up(rms_norm(x)))) in place for the quantized gate_up W [2F, D] (rows gate, then up)
    and down [D, F], each (q, scale, low, group) of one format (bits, offset): one launch (module doc), the
    roundings of gate_up_swiglu_qfwd then qgemv_fwd's residual epilogue -> x. config: (gate_up's QGemvConfig,
    down's, the QMlpConfig), default `mlp_configs`. pdl: as qgemv_fwd."""
    (gq, gs, gm, g_group), (dq, ds, dm, d_group) = gate_up, down
    N, D = gq.shape[0], x.numel()
    F = N // 2
    assert N == 2 * F and dq.shape[0] == D and (gm is None) == (dm is None), "gate_up [2F, D], down [D, F]"
    _operands(gq, gs, gm, x, D, norm_weight)
    _operands(dq, ds, dm)
    g_row, d_row = per_row_scales(g_group, D, gm), per_row_scales(d_group, F, dm)
    gcfg, dcfg, launch = config or mlp_configs(N, D, F, bits, g_group, d_group, sm_count(gq.device))
    gcfg, dcfg = QGemvConfig(*gcfg), QGemvConfig(*dcfg)
    assert not gcfg.programs and not dcfg.programs, "one ticket a block: no persistent programs"
    _launch_checks(gcfg, bits, g_group, g_row, D)
    _launch_checks(dcfg, bits, d_group, d_row, F)
    hn = half_block(gcfg)
    n_up = triton.cdiv(F, hn)
    pack = 8 // bits
    blocks = triton.cdiv(D, dcfg.block_n)
    k_split, split = k_slices(dcfg, F)
    assert k_split % hn == 0 and split <= 32, "a gate_up block's h inside one of down's K slices (at most 32)"
    p, c = split_scratch(x.device, split * D, blocks) if split > 1 else (x, x)
    cnt = chain.chain_counters(x.device, _CNT_AT + _CNT_N)[_CNT_AT:]
    # down's whole slice into L2 while it waits (a hint; the interpreter has no prefetch)
    d_lines = triton.next_power_of_2(triton.cdiv(k_split // pack, 128)) if launch.prefetch and pdl_available(dq) else 0
    h = torch.empty(F, dtype=x.dtype, device=x.device)
    _mlp_kernel[(n_up + blocks * split,)](
        gq, gs, gm if gm is not None else gs, x, norm_weight, h, dq, ds, dm if dm is not None else ds, p, c, cnt, F,
        D, triton.cdiv(D, pack), triton.cdiv(F, pack), gq.stride(0), gs.stride(0), dq.stride(0), ds.stride(0),
        float(eps), gs.shape[1], ds.shape[1], k_split // pack, k_split, n_up, blocks, BITS=bits, OFFSET=offset,
        HAS_MIN=gm is not None, G_GROUP=g_group, G_PER_ROW=g_row, G_BLOCK_N=gcfg.block_n, G_BLOCK_K=gcfg.block_k,
        G_STAGES=gcfg.stages, G_FAST=_fast(gq, bits, D), D_POW2=triton.next_power_of_2(D), D_GROUP=d_group,
        D_PER_ROW=d_row, D_BLOCK_N=dcfg.block_n, D_BLOCK_K=dcfg.block_k, D_STAGES=dcfg.stages,
        D_FAST=_fast(dq, bits, F), SPLIT_K=split, SPLIT_POW2=triton.next_power_of_2(split), D_PF_LINES=d_lines,
        num_warps=launch.warps, num_stages=max(gcfg.stages, dcfg.stages),
        **_pdl_kwargs(pdl, gq, gcfg, bits, gq.shape[1], rope=False))
    return x
