"""Chained phases in one launch: a kernel whose programs do phase A's work, then phase B's, where B's work reads what
all (or some) of A's wrote — two dependent decode-step kernels without the kernel boundary between them, so B's
programs can load their own operands (weights) while A's last programs still run.

Work is handed out by ticket, not by program id: a program takes the next ticket as it starts (`take_ticket`), and
tickets 0..A-1 are A's work. So a program that waits for A's work only exists once every A ticket has been taken
by a started, resident program — the launch cannot deadlock on A programs still waiting for an SM, whatever order
the hardware starts programs in. A's programs count themselves done (`count_done`, after their stores); B's wait
for the count (`wait_count`, which ends in an acquire), then read A's output (`.cg` loads bypass L1 where a
program may have read the same lines before the wait).

The counters live in one buffer a device (`chain_counters`, each launch its own region), zeros between launches: a
program that knows no other program of the launch will touch a counter again returns it to 0 (`reset`) — the one
counting the launch's last work done, or for the ticket counter the one drawing the last ticket — so the next launch
(or graph replay) finds them zeroed. Launches that share counters must not run concurrently (one stream: the
decode step).
Under TRITON_INTERPRET=1 programs run one after another in program-id order: tickets equal program ids, and every
wait is already satisfied when it is reached.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def take_ticket(CNT):
    """This program's place in the order the launch's programs started (counter CNT, from 0)."""
    return tl.atomic_add(CNT, 1, sem="relaxed", scope="gpu")


@triton.jit
def count_done(CNT):
    """Count one unit of work done on CNT and return the count before it; the CTA barrier orders every thread's
    stores before the one release-add (a scalar atomic: one thread)."""
    tl.debug_barrier()
    return tl.atomic_add(CNT, 1, sem="acq_rel", scope="gpu")


@triton.jit
def wait_count(CNT, target):
    """Spin until CNT has counted `target`, then acquire: what the counted programs stored is visible after it (to
    loads that bypass L1). The spin polls with plain volatile loads, not atomics: hundreds of waiting programs would
    otherwise queue read-modify-writes on the counter ahead of the adds they wait for; the barrier puts every
    thread's later loads after the one acquiring thread's atomic."""
    n = tl.load(CNT, volatile=True)
    while n < target:
        n = tl.load(CNT, volatile=True)
    tl.atomic_add(CNT, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def reset(CNT, n: tl.constexpr):
    """CNT[0:n] back to 0 — only by the program that knows every other program of the launch is done with them."""
    tl.store(CNT + tl.arange(0, n), tl.zeros([n], tl.int32))


class CaptureBeforeCounters(RuntimeError):
    """chain_counters was first asked for inside a CUDA graph capture."""


_COUNTERS: dict[torch.device, torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []  # an outgrown buffer stays allocated: a captured graph may still point at it


def chain_counters(device: torch.device, n: int) -> torch.Tensor:
    """n int32 counters (zeros between launches), one buffer a device, grown on demand. Must exist before a CUDA
    graph capture (a zero-fill captured into a graph would not run before its first replay): the engine's warm-up
    steps create it."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise CaptureBeforeCounters("chain counters must be allocated before a CUDA graph capture (warm up first)")
        if buf is not None:
            _RETIRED.append(buf)
        buf = torch.zeros(max(n, 64), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf
