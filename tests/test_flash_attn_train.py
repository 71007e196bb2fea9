"""FlashAttention for training (accel/kernels/flash_attn_train.py via accel.train.attention.flash_attention).

CPU, under TRITON_INTERPRET=1, fp32 (exact IEEE dots): the Triton forward and backward against the NumPy oracles
(refimpl cross_attention forward, refimpl.train.grads.attention_backward) within 1e-5, on odd lengths, GQA ratios
1/2/4/8, causal and not, padding masks; finite differences of the autograd Function; gradcheck of the plain-torch
fallback in fp64. GPU (skipped without CUDA): against torch SDPA's backward at real shapes in bf16 and fp32.
"""
import os

import numpy as np
import pytest
import torch

from refimpl.model import ops as R
from refimpl.train import grads

from accel.kernels.flash_attn_train import flash_attn_bwd, flash_attn_train_fwd
from accel.train.attention import attention_reference, flash_attention

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="CPU-interpreter coverage; the GPU's is below")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def padding_mask(lengths, T, S):
    """[B, T, S] bool: sequence b has lengths[b] real tokens; padded queries see nothing, nobody sees padded keys."""
    L = torch.tensor(lengths)[:, None, None]
    return (torch.arange(T)[None, :, None] < L) & (torch.arange(S)[None, None, :] < L)


def inputs(B, T, S, H, K, E, seed, dtype=torch.float32, device="cpu"):
    g = torch.Generator(device=device).manual_seed(seed)
    mk = lambda *shape: torch.randn(shape, generator=g, device=device, dtype=torch.float32).to(dtype)  # noqa: E731
    return mk(B, T, H, E), mk(B, S, K, E), mk(B, S, K, E), mk(B, T, H, E)


def oracle(q, k, v, do, causal, mask):
    """Per sequence: refimpl's forward (cross_attention over the visible [T, S]) and the NumPy backward."""
    outs, dqs, dks, dvs = [], [], [], []
    for b in range(q.shape[0]):
        qb, kb, vb, dob = (x[b].double().numpy() for x in (q, k, v, do))
        mb = None if mask is None else mask[b].numpy()
        visible = grads.attention_visible(qb.shape[0], kb.shape[0], causal, mb)
        outs.append(R.cross_attention(qb, kb.transpose(1, 0, 2), vb.transpose(1, 0, 2), visible))
        dq, dk, dv = grads.attention_backward(qb, kb, vb, dob, causal, mb)
        dqs.append(dq), dks.append(dk), dvs.append(dv)
    return [torch.from_numpy(np.stack(x)) for x in (outs, dqs, dks, dvs)]


def triton_grads(q, k, v, do, causal, mask, configs=None):
    o, lse = flash_attn_train_fwd(q, k, v, causal, mask, config=configs and configs["fwd"])
    return (o, *flash_attn_bwd(q, k, v, o, lse, do, causal, mask, configs))


CASES = [  # B, T, S, H, K, E, causal, lengths (padding) or None
    (1, 1, 1, 2, 2, 16, True, None),  # GQA 1, one token
    (2, 7, 7, 4, 2, 16, True, None),  # GQA 2
    (2, 23, 23, 4, 1, 16, True, [23, 14]),  # GQA 4, padded
    (1, 33, 33, 8, 1, 16, False, None),  # GQA 8, non-causal
    (2, 17, 29, 4, 1, 64, False, [17, 9]),  # E=64, T != S, padded
    (1, 20, 20, 2, 1, 80, True, [13]),  # E=80 (vision), padded
]


@interpreted
@pytest.mark.parametrize("B,T,S,H,K,E,causal,lengths", CASES)
def test_against_numpy_oracle(B, T, S, H, K, E, causal, lengths):
    q, k, v, do = inputs(B, T, S, H, K, E, seed=T * 100 + H)
    mask = None if lengths is None else padding_mask(lengths, T, S)
    got = triton_grads(q, k, v, do, causal, mask)
    for name, g, w in zip(("o", "dq", "dk", "dv"), got, oracle(q, k, v, do, causal, mask)):
        torch.testing.assert_close(g.double(), w, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")
    if lengths is not None and min(lengths) < T:  # padded query rows: output 0 and no gradient
        b = int(np.argmin(lengths))
        assert not got[0][b, lengths[b]:].any() and not got[1][b, lengths[b]:].any()


@interpreted
@pytest.mark.parametrize("bm,bn,split", [(16, 32, 1), (32, 16, 2)])
def test_other_tiles_and_random_mask(bm, bn, split):
    """Unequal query/key blocks (the causal loop splits of both passes), the dK/dV pass's head split, and a random
    mask with empty rows."""
    B, T, S, H, K, E = 1, 45, 45, 4, 2, 16
    q, k, v, do = inputs(B, T, S, H, K, E, seed=bm)
    mask = torch.rand(B, T, S, generator=torch.Generator().manual_seed(bn)) > 0.5
    mask[:, 5] = False
    cfg = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=4, num_stages=1)
    got = triton_grads(q, k, v, do, True, mask, {"fwd": cfg, "dq": cfg, "dkdv": {**cfg, "SPLIT": split}})
    for name, g, w in zip(("o", "dq", "dk", "dv"), got, oracle(q, k, v, do, True, mask)):
        torch.testing.assert_close(g.double(), w, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")


@interpreted
def test_autograd_function_finite_differences():
    """The autograd Function's gradients against central differences of its own forward (fp32, tiny shape):
    the directional derivative along a random direction of each input."""
    q, k, v, w = inputs(1, 6, 6, 4, 2, 16, seed=3)
    mask = padding_mask([5], 6, 6)
    args = [q.requires_grad_(), k.requires_grad_(), v.requires_grad_()]
    loss = lambda *x: (flash_attention(*x, causal=True, mask=mask) * w).sum()  # noqa: E731
    analytic = torch.autograd.grad(loss(*args), args)
    eps = 1e-2
    for i, a in enumerate(args):
        u = torch.randn(a.shape, generator=torch.Generator().manual_seed(i))
        with torch.no_grad():
            plus = [x + eps * u if j == i else x for j, x in enumerate(args)]
            minus = [x - eps * u if j == i else x for j, x in enumerate(args)]
            fd = (loss(*plus) - loss(*minus)) / (2 * eps)
        assert (analytic[i] * u).sum().item() == pytest.approx(fd.item(), rel=2e-3, abs=1e-3)


def test_torch_fallback_gradcheck_fp64():
    """The plain-torch path (CPU without the interpreter) through torch.autograd.gradcheck, with an empty row."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 2, 4, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 5, 1, 4, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 5, 1, 4, generator=g, dtype=torch.float64, requires_grad=True)
    mask = padding_mask([4, 2], 4, 5)
    for causal in (True, False):
        assert torch.autograd.gradcheck(lambda *x: attention_reference(*x, causal=causal, mask=mask), (q, k, v),
                                        fast_mode=True)


def test_torch_fallback_matches_oracle():
    q, k, v, do = inputs(2, 9, 11, 4, 2, 8, seed=5)
    mask = padding_mask([9, 4], 9, 11)
    args = [x.double().requires_grad_() for x in (q, k, v)]
    o = attention_reference(*args, causal=False, mask=mask)
    got = (o, *torch.autograd.grad(o, args, do.double()))
    for name, g, w in zip(("o", "dq", "dk", "dv"), got, oracle(q, k, v, do, False, mask)):
        # 1e-6, not 1e-12: refimpl's forward rounds its scale constant to fp32
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-6, msg=lambda m: f"{name}: {m}")


# ---- GPU: against torch SDPA's backward at real shapes --------------------------------------------------------

def sdpa_grads(q, k, v, do, causal, mask):
    """torch SDPA on [B, H, T, E] with K/V repeated per query head (autograd sums the copies back)."""
    args = [x.detach().requires_grad_() for x in (q, k, v)]
    G = q.shape[2] // k.shape[2]
    qs, ks, vs = (a.transpose(1, 2) for a in args)
    ks, vs = ks.repeat_interleave(G, 1), vs.repeat_interleave(G, 1)
    o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=None if mask is None else
                                                         mask[:, None], is_causal=causal).transpose(1, 2)
    return (o, *torch.autograd.grad(o, args, do))


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


GPU_CASES = [  # B, T, H, K, E, causal, vision-style padding
    (1, 2048, 32, 8, 64, True, False),  # Llama 3.2 1B
    (1, 2048, 24, 8, 128, True, False),  # Llama 3.2 3B
    (1, 1608, 16, 16, 80, False, True),  # vision encoder: 1601 real patch tokens padded to 1608, pad×pad masked
    (2, 1000, 8, 2, 64, True, False),  # odd length, batch 2
]


@cuda
@pytest.mark.parametrize("B,T,H,K,E,causal,vision", GPU_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_against_sdpa_gpu(B, T, H, K, E, causal, vision, dtype):
    q, k, v, do = inputs(B, T, T, H, K, E, seed=T + E, dtype=dtype, device="cuda")
    mask = None
    if vision:  # real tokens attend to padding too; only pad×pad pairs are masked (as Mllama)
        pad = torch.arange(T, device="cuda") >= 1601
        mask = (~(pad[:, None] & pad[None, :])).expand(B, T, T)
    ref = sdpa_grads(q.float(), k.float(), v.float(), do.float(), causal, mask)  # fp32 math on the same inputs
    args = [x.detach().requires_grad_() for x in (q, k, v)]
    o = flash_attention(*args, causal=causal, mask=mask)
    got = (o, *torch.autograd.grad(o, args, do))
    if dtype == torch.float32:
        for name, g, r in zip(("o", "dq", "dk", "dv"), got, ref):
            assert rel(g, r) < 1e-4, (name, rel(g, r))
    else:  # bf16: no worse than SDPA's own bf16 kernels against the same fp32 reference (and small)
        base = sdpa_grads(q, k, v, do, causal, mask)
        for name, g, s, r in zip(("o", "dq", "dk", "dv"), got, base, ref):
            assert rel(g, r) < max(2 * rel(s, r), 1e-3) and rel(g, r) < 2e-2, (name, rel(g, r), rel(s, r))
    again = torch.autograd.grad(flash_attention(*args, causal=causal, mask=mask), args, do)
    assert all(torch.equal(a, b) for a, b in zip(got[1:], again)), "backward must be deterministic"
