"""Triton helpers shared by the decode-step kernels (gemv.py, qgemv.py, qkv_rope.py): the GEMV prologue f(x), the
RMSNorm reciprocal, an unmasked-row weight tile, the residual epilogue, the split-K scratch, the decode attention's
arrival counters, the SM count the launch rules size their grids by, and programmatic dependent launch (PDL) with an
L2 prefetch hint."""
from __future__ import annotations

import contextlib
import contextvars
import functools
import os

import torch
import triton
import triton.language as tl

PROLOGUE_NONE, PROLOGUE_NORM, PROLOGUE_SWIGLU = 0, 1, 2


def pdl_available(t: torch.Tensor) -> bool:
    """Whether kernels over t can be launched with PDL (programmatic dependent launch: CUDA sm_90+, compiled;
    the interpreter has no griddepcontrol) — also where TMA descriptors exist. Cached per device: launchers
    call it every launch."""
    return t.is_cuda and _pdl_device(t.device)


_PDL_LAUNCHES = contextvars.ContextVar("accel_kernels_pdl_launches", default=False)


@contextlib.contextmanager
def setting(var: contextvars.ContextVar, value):
    """`var` set to `value` within the block (a CUDA graph's capture included)."""
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


def pdl_launches(on: bool = True):
    """Within this block, the kernels whose launchers ask `launch_pdl` (the prefill's embedding + RMSNorm,
    RMSNorm, RoPE + cache write, flash attention, SwiGLU) launch as programmatic dependents: each waits for the
    kernel before it at its start, before any load or store, so its launch overlaps that kernel's drain. Off by
    default."""
    return setting(_PDL_LAUNCHES, on)


def launch_pdl(t: torch.Tensor) -> bool:
    """Whether a kernel over t launches as a programmatic dependent here (pdl_launches on, and PDL available)."""
    return _PDL_LAUNCHES.get() and pdl_available(t)


def per_row_scales(group: int, K: int, low) -> bool:
    """One scale a row, applied after the sum (int8); int4 with G >= K keeps the group path (its minima). The
    decode GEMVs and the prefill's dequantize must agree on it."""
    return group >= K and low is None


def pdl_kw(pdl: bool) -> dict:
    """The launch keyword of a PDL launch (none otherwise: the interpreter's launcher takes no such keyword)."""
    return {"launch_pdl": True} if pdl else {}


@triton.jit
def gdc_wait():
    """Wait until the previous kernel in the stream has finished and its writes are visible (a no-op when this
    kernel was not launched with PDL). Inline PTX, as triton's own, kept even though its result is unused."""
    tl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def gdc_launch_dependents():
    """Let the next kernel in the stream, if launched with PDL, start now (it waits for our writes itself)."""
    tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=tl.int32,
                              is_pure=False, pack=1)


@functools.lru_cache(maxsize=None)
def _pdl_device(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9 and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


@triton.jit
def prefetch_l2(ptrs):
    """An L2 prefetch of each address (one 128-byte line each): a hint, no result. GPU only (inline PTX)."""
    tl.inline_asm_elementwise("mov.u32 $0, 0;\n\tprefetch.global.L2 [$1];", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def prefetch_rows_l2(W, rows_c, stride, lo, hi, LINE: tl.constexpr, LINES: tl.constexpr):
    """An L2 prefetch of W[rows_c, lo : min(hi, lo + LINES·LINE)], one LINE-element (128-byte) line a prefetch:
    a PDL-launched GEMV's weights, fetched while the kernel before it drains (addresses clamped, not masked: the
    asm takes no mask; a repeated line costs one more hint)."""
    cols = tl.minimum(lo + tl.arange(0, LINES) * LINE, hi - 1)  # [LINES]
    prefetch_l2(W + rows_c[:, None] * stride + cols[None, :])


@triton.jit
def prologue_fx(X, NW, k0, cols, K, rstd, PROLOGUE: tl.constexpr, EVEN_K: tl.constexpr):
    """f(x)[k0 : k0 + BLOCK_K] in fp32 (zeros past K)."""
    offs = k0 + cols
    inside = offs < K
    if EVEN_K:
        x = tl.load(X + offs)
    else:
        x = tl.load(X + offs, mask=inside, other=0.0)
    dt = X.dtype.element_ty
    if PROLOGUE == 1:  # HF RMSNorm: normalize in fp32, round to the dtype, times the weight, round again
        if EVEN_K:
            nw = tl.load(NW + offs)
        else:
            nw = tl.load(NW + offs, mask=inside, other=0.0)
        normed = (x.to(tl.float32) * rstd).to(dt)
        return (normed.to(tl.float32) * nw.to(tl.float32)).to(dt).to(tl.float32)
    elif PROLOGUE == 2:  # silu(gate) rounded, then the product rounded (two bf16 torch ops)
        if EVEN_K:
            u = tl.load(X + K + offs)
        else:
            u = tl.load(X + K + offs, mask=inside, other=0.0)
        g = x.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(dt)
        return (act.to(tl.float32) * u.to(tl.float32)).to(dt).to(tl.float32)
    else:
        return x.to(tl.float32)


@triton.jit
def rms_rstd(X, K, eps, K_POW2: tl.constexpr):
    """1 / rms(x[0:K]) in fp32, the whole x in one round of loads (K <= K_POW2 <= 8192: <= 32 values a thread)."""
    kk = tl.arange(0, K_POW2)
    xs = tl.load(X + kk, mask=kk < K, other=0.0).to(tl.float32)
    return tl.rsqrt(tl.sum(xs * xs, axis=0) / K + eps)


@triton.jit
def row_tile(W, rows_c, stride_w, k0, cols, K, EVEN_K: tl.constexpr):
    """W[rows_c, k0 : k0 + BK] ([BN, BK], zeros past K)."""
    ptrs = W + rows_c[:, None] * stride_w + k0 + cols[None, :]
    if EVEN_K:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=k0 + cols[None, :] < K, other=0.0)


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0


@triton.jit
def epilogue(acc, R, Y, rows, N, HAS_RESIDUAL: tl.constexpr, GATE=None, HAS_GATE: tl.constexpr = False):
    """Y = [R +] [gate ·] acc; GATE: a one-element tensor (a cross layer's tanh gate), its product rounded too.
    A gate without R: a tensor-parallel rank's gated partial sum (accel.tp), gate · round(acc)."""
    if HAS_GATE:  # round the product first, as the unfused F.linear then `g * o` does
        acc = acc.to(Y.dtype.element_ty).to(tl.float32) * tl.load(GATE).to(tl.float32)
    if HAS_RESIDUAL:  # round the product (gate · o) first, as the unfused F.linear then `x + r` does
        acc = acc.to(Y.dtype.element_ty).to(tl.float32) + tl.load(R + tl.minimum(rows, N - 1)).to(tl.float32)
    tl.store(Y + rows, acc.to(Y.dtype.element_ty), mask=rows < N)


_SCRATCH: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
_RETIRED: list[torch.Tensor] = []  # outgrown scratch stays allocated: a captured graph may still point at it


def split_scratch(device: torch.device, partials: int, counters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A split-K GEMV's fp32 partials (gemv.py, qgemv.py) and per-row-block arrival counters (zeros between
    launches), one pair a device, grown on demand and never shrunk (callers of different needs do not trade it back
    and forth). One stream at a time (the decode step): two split GEMVs running concurrently on different streams
    would share them. Grown before a graph capture by the engine's warm-up steps."""
    p, c = _SCRATCH.get(device, (None, None))
    if p is None or p.numel() < partials or c.numel() < counters:
        if p is not None:
            _RETIRED.extend((p, c))
            partials, counters = max(partials, p.numel()), max(counters, c.numel())
        # sized for every Llama 3.2 shape at once (16 slices × 16384 rows; 16384 / 4 row blocks): 1 MB
        p = torch.empty(max(partials, 1 << 18), dtype=torch.float32, device=device)
        c = torch.zeros(max(counters, 1 << 13), dtype=torch.int32, device=device)
        _SCRATCH[device] = (p, c)
    return p, c


@triton.jit
def split_k_epilogue(part, P, CNT, R, Y, rows, N, s, b, SPLIT_K: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                     GATE=None, HAS_GATE: tl.constexpr = False):
    """part [BLOCK_N] fp32, the product over K slice `s` of row block `b`. SPLIT_K == 1: the epilogue at once. Else
    the partial goes to P; the row block's last program to arrive sums the slices in slice order (deterministic) and
    runs the epilogue, then resets its counter in CNT for the next launch."""
    if SPLIT_K == 1:
        epilogue(part, R, Y, rows, N, HAS_RESIDUAL, GATE, HAS_GATE)
    else:
        tl.store(P + s * N + rows, part, mask=rows < N)
        # the CTA barrier orders every thread's partial stores before the one acq_rel add (a scalar atomic, one
        # thread): the last program to arrive has acquired all partials (the pattern of accel/kernels/decode_attn)
        tl.debug_barrier()
        ticket = tl.atomic_add(CNT + b, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT_K - 1:
            acc = tl.zeros_like(part)
            for j in range(0, SPLIT_K):
                acc += tl.load(P + j * N + rows, mask=rows < N, other=0.0, cache_modifier=".cg")
            epilogue(acc, R, Y, rows, N, HAS_RESIDUAL, GATE, HAS_GATE)
            tl.store(CNT + b, 0)


@triton.jit
def count_done(CNT):
    """Count one unit of work done on CNT and return the count before it; the CTA barrier orders every thread's
    stores before the one release-add (a scalar atomic: one thread)."""
    tl.debug_barrier()
    return tl.atomic_add(CNT, 1, sem="acq_rel", scope="gpu")


class CaptureBeforeCounters(RuntimeError):
    """arrival_counters was first asked for inside a CUDA graph capture."""


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def arrival_counters(device: torch.device, n: int) -> torch.Tensor:
    """n int32 counters (zeros between launches: the program counting the last arrival returns its counter to 0),
    one buffer a device, grown on demand (an outgrown buffer stays allocated: a captured graph may still point at
    it). Must exist before a CUDA graph capture (a zero-fill captured into a graph would not run before its first
    replay): the engine's warm-up steps create it. Launches sharing it must not run concurrently (one stream)."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise CaptureBeforeCounters("arrival counters must exist before a CUDA graph capture (warm up first)")
        if buf is not None:
            _RETIRED.append(buf)
        buf = torch.zeros(max(n, 64), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf
