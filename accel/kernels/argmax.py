"""Greedy next token in one launch: the first index of the maximum of the logits [V], written where the next
decode step reads its token, optionally also appended to a token history and the position advanced.

Two stages in one kernel: each program reduces BLOCK logits to (max, first index of it), then the program that
draws the last ticket (the acq_rel counter pattern of accel/kernels/decode_attn.py) reduces the programs' pairs
and re-arms the counter. Ties go to the lowest index and NaN counts as the largest value, as torch.argmax does.

Why: torch's argmax over V = 128256 is one slow single-block reduction; the two torch stages of
accel.ops.torch_ops.torch_argmax_row take three more small index kernels, and a greedy loop then adds the token
copy and the position increment: ~8 launches a token outside the CUDA graph. With this kernel inside
the graph (accel.engine.Decoder's greedy graph) a token is one replay and nothing else.

argmax_rows_fwd does the same for the rows of a batch [R, V] (a grid of rows × programs, one counter a row), and
says per row whether all its logits are finite: the batch engine's decode graph ends with it (accel/batch/graphs.py),
so a greedy step's tokens and its NaN check are read back with no kernel after the replay.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .tuning import ARGMAX_BLOCK


@triton.jit
def _argmax_kernel(X, V, PV, PI, CNT, TOKEN, POS, HIST, STEP, BLOCK: tl.constexpr, P_POW2: tl.constexpr,
                   ADVANCE: tl.constexpr):
    pid = tl.program_id(0)
    n = tl.num_programs(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("inf"), x)  # NaN wins (torch.argmax's rule); a NaN beats an inf only in torch
    m = tl.max(x, axis=0)
    first = tl.min(tl.where(x == m, offs, V), axis=0)  # the padding (offs >= V) never precedes a real index
    tl.store(PV + pid, m)
    tl.store(PI + pid, first)
    tl.debug_barrier()  # every thread's stores before the one acq_rel ticket (decode_attn.py's pattern)
    ticket = tl.atomic_add(CNT, 1, sem="acq_rel", scope="gpu")
    if ticket == n - 1:
        j = tl.arange(0, P_POW2)
        pv = tl.load(PV + j, mask=j < n, other=float("-inf"), cache_modifier=".cg")
        pi = tl.load(PI + j, mask=j < n, other=V, cache_modifier=".cg")
        best = tl.min(tl.where(pv == tl.max(pv, axis=0), pi, V), axis=0)  # programs are in index order
        tl.store(TOKEN, best.to(tl.int64))
        if ADVANCE:  # the greedy loop's bookkeeping: history[step] = token, step += 1, position += 1
            step = tl.load(STEP)
            tl.store(HIST + step, best.to(tl.int64))
            tl.store(STEP, step + 1)
            tl.store(POS, tl.load(POS) + 1)
        tl.store(CNT, 0)


_SCRATCH: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
_RETIRED: list[tuple] = []  # outgrown scratch stays allocated: a captured graph may still point at it


def _scratch(device: torch.device, programs: int):
    """Per-program partials and the arrival counter (zero between launches), one set a device, grown on
    demand before any graph capture (the engine's warm-up steps run this first)."""
    s = _SCRATCH.get(device)
    if s is None or s[0].numel() < programs:
        if s is not None:
            _RETIRED.append(s)
        s = (torch.empty(max(programs, 256), dtype=torch.float32, device=device),
             torch.empty(max(programs, 256), dtype=torch.int32, device=device),
             torch.zeros(1, dtype=torch.int32, device=device))
        _SCRATCH[device] = s
    return s


def argmax_fwd(logits: torch.Tensor, token: torch.Tensor | None = None, position: torch.Tensor | None = None,
               history: torch.Tensor | None = None, step: torch.Tensor | None = None) -> torch.Tensor:
    """logits [V] or [1, V] -> token [1] int64 (into `token` if given), the first index of the maximum.
    With position/history/step ([1], [n], [1] int64): also history[step] = token, step += 1, position += 1."""
    x = logits.reshape(-1)
    assert x.stride(0) == 1
    V = x.numel()
    token = torch.empty(1, dtype=torch.int64, device=x.device) if token is None else token
    advance = position is not None
    assert not advance or (history is not None and step is not None)
    programs = triton.cdiv(V, ARGMAX_BLOCK)
    pv, pi, cnt = _scratch(x.device, programs)
    _argmax_kernel[(programs,)](x, V, pv, pi, cnt, token, position if advance else token,
                                history if advance else token, step if advance else token, BLOCK=ARGMAX_BLOCK,
                                P_POW2=max(16, triton.next_power_of_2(programs)), ADVANCE=advance, num_warps=4)
    return token


@triton.jit
def _argmax_rows_kernel(X, sx, V, PV, PI, PF, CNT, OUT, so, BLOCK: tl.constexpr, P_POW2: tl.constexpr):
    r = tl.program_id(0)
    pid = tl.program_id(1)
    n = tl.num_programs(1)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    ok = offs < V
    x = tl.load(X + r * sx + offs, mask=ok, other=float("-inf")).to(tl.float32)
    bad = tl.sum(((x != x) | (tl.abs(x) == float("inf"))) & ok, axis=0)  # NaN or ±inf among the real logits
    x = tl.where(x != x, float("inf"), x)  # NaN wins, as in _argmax_kernel
    m = tl.max(x, axis=0)
    first = tl.min(tl.where(x == m, offs, V), axis=0)
    base = r * n
    tl.store(PV + base + pid, m)
    tl.store(PI + base + pid, first)
    tl.store(PF + base + pid, bad.to(tl.int32))
    tl.debug_barrier()  # every thread's stores before the row's acq_rel ticket
    ticket = tl.atomic_add(CNT + r, 1, sem="acq_rel", scope="gpu")
    if ticket == n - 1:  # the row's last program reduces its programs' pairs and re-arms the row's counter
        j = tl.arange(0, P_POW2)
        pv = tl.load(PV + base + j, mask=j < n, other=float("-inf"), cache_modifier=".cg")
        pi = tl.load(PI + base + j, mask=j < n, other=V, cache_modifier=".cg")
        pf = tl.load(PF + base + j, mask=j < n, other=0, cache_modifier=".cg")
        best = tl.min(tl.where(pv == tl.max(pv, axis=0), pi, V), axis=0)  # programs are in index order
        tl.store(OUT + r, best.to(tl.int64))
        tl.store(OUT + so + r, (tl.sum(pf, axis=0) == 0).to(tl.int64))
        tl.store(CNT + r, 0)


ROWS_BLOCK = 4096  # argmax_rows_fwd: 32 programs a row of V = 128256 (2048 at 64 rows)
_ROW_SCRATCH: dict[torch.device, tuple[torch.Tensor, ...]] = {}


def _row_scratch(device: torch.device, rows: int, programs: int):
    """Per-(row, program) partials and one arrival counter a row (zero between launches), as _scratch."""
    s = _ROW_SCRATCH.get(device)
    if s is None or s[0].numel() < rows * programs or s[3].numel() < rows:
        if s is not None:
            _RETIRED.append(s)
        n, r = max(rows * programs, 4096), max(rows, 256)
        s = (torch.empty(n, dtype=torch.float32, device=device), torch.empty(n, dtype=torch.int32, device=device),
             torch.empty(n, dtype=torch.int32, device=device), torch.zeros(r, dtype=torch.int32, device=device))
        _ROW_SCRATCH[device] = s
    return s


def argmax_rows_fwd(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """logits [R, V] (unit stride along V) -> [2, R] int64: row 0 each row's first index of its maximum (NaN the
    largest, as torch.argmax), row 1 whether every logit of the row is finite (1) or not (0). One launch."""
    R, V = logits.shape
    assert logits.stride(1) == 1
    out = torch.empty((2, R), dtype=torch.int64, device=logits.device) if out is None else out
    assert out.shape == (2, R) and out.stride(1) == 1
    if R == 0:
        return out
    programs = triton.cdiv(V, ROWS_BLOCK)
    pv, pi, pf, cnt = _row_scratch(logits.device, R, programs)
    _argmax_rows_kernel[(R, programs)](logits, logits.stride(0), V, pv, pi, pf, cnt, out, out.stride(0),
                                       BLOCK=ROWS_BLOCK, P_POW2=max(16, triton.next_power_of_2(programs)),
                                       num_warps=4)
    return out
