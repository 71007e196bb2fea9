"""accel/kernels/chain.py: two dependent phases in one launch (tickets, done counts, waits). Under the interpreter
programs run in order; on a GPU the phases really overlap, so a B program that read before A's stores were visible
would produce a wrong sum."""
import os

import pytest
import torch

from accel.kernels import chain

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402


@triton.jit
def _two_phase_kernel(X, Y, OUT, CNT, N_A, N_B, BLOCK: tl.constexpr):
    """Phase A (tickets 0..N_A-1): Y[t·BLOCK + i] = 2·X[...] + 1. Phase B (tickets N_A..): OUT[t - N_A] = Σ Y."""
    t = chain.take_ticket(CNT)
    offs = tl.arange(0, BLOCK)
    if t < N_A:
        x = tl.load(X + t * BLOCK + offs)
        tl.store(Y + t * BLOCK + offs, 2.0 * x + 1.0)
        chain.count_done(CNT + 1)
    else:
        chain.wait_count(CNT + 1, N_A)
        total = tl.zeros([BLOCK], tl.float32)
        for a in range(0, N_A):
            total += tl.load(Y + a * BLOCK + offs, cache_modifier=".cg")
        tl.store(OUT + (t - N_A), tl.sum(total, axis=0))
        if chain.count_done(CNT + 2) == N_B - 1:  # the launch's last work: every counter back to 0
            chain.reset(CNT, 4)


def _device():
    if torch.cuda.is_available():
        return torch.device("cuda")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the kernel needs CUDA or TRITON_INTERPRET=1")
    return torch.device("cpu")


@pytest.mark.parametrize("n_a,n_b", [(3, 2), (1, 1)] + ([(1500, 700)] if torch.cuda.is_available() else []))
def test_two_phases_in_one_launch(n_a, n_b):
    dev = _device()
    block = 32
    gen = torch.Generator().manual_seed(n_a * 31 + n_b)
    cnt = chain.chain_counters(dev, 4)
    for rep in range(3):  # the counters come back zeroed: later launches see a fresh state
        x = torch.randint(-8, 8, (n_a * block,), generator=gen).float().to(dev)
        y = torch.full_like(x, float("nan"))
        out = torch.full((n_b,), float("nan"), device=dev)
        _two_phase_kernel[(n_a + n_b,)](x, y, out, cnt, n_a, n_b, BLOCK=block)
        want = (2.0 * x + 1.0).sum().item()  # small integers: exact in fp32 in any order
        assert torch.equal(out.cpu(), torch.full((n_b,), want)), (rep, out[:4].tolist(), want)
        assert cnt[:4].tolist() == [0, 0, 0, 0]

