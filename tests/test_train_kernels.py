"""The training path's fused ops (accel/train/fused.py, accel/train/loss.py); its layers: test_train_layers.py.

CPU, under TRITON_INTERPRET=1, fp32 on odd shapes: each Triton forward and backward against the refimpl forward and
the NumPy gradient oracle (refimpl/train/grads.py); each autograd Function against an fp32 central difference along
a random direction; the fused linear + cross-entropy (Triton row kernel and its torch twin) against the oracle's loss
and gradient, ignored rows included. GPU (skipped without CUDA): bf16 at real shapes against the plain-torch ops
differentiated by autograd.
"""
import os

import numpy as np
import pytest
import torch

from refimpl.model import ops as R
from refimpl.train import grads

from accel.kernels.cross_entropy import cross_entropy_rows_
from accel.train import fused
from accel.train.loss import cross_entropy_rows_torch, linear_cross_entropy
from accel.train.model import rms_norm, rope, swiglu

from tests._train_helpers import BF16, close, cuda, interpreted, np64, randn, rel_l2, tables


def directional_check(fn, inputs, seed=1, eps=1e-2, rtol=2e-3):
    """Autograd's d<fn(x), w>/dx · v against the fp32 central difference (L(x + εv) − L(x − εv)) / 2ε, for a random
    projection w of the outputs and a random direction v of every differentiable input."""
    outs = fn(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    ws = [randn(*o.shape, seed=seed + i) for i, o in enumerate(outs)]
    loss = lambda *xs: sum((o.double() * w.double()).sum() for o, w in zip(  # noqa: E731
        (lambda r: r if isinstance(r, tuple) else (r,))(fn(*xs)), ws))
    diff = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    vs = [randn(*x.shape, seed=seed + 10 + i) for i, x in enumerate(diff)]
    g = torch.autograd.grad(loss(*inputs), diff)
    analytic = sum(float((gi.double() * v.double()).sum()) for gi, v in zip(g, vs))

    def shifted(sign):
        it = iter(vs)
        xs = [(x.detach() + sign * eps * next(it)) if isinstance(x, torch.Tensor) and x.requires_grad else x
              for x in inputs]
        with torch.no_grad():
            return float(loss(*xs))
    numeric = (shifted(1) - shifted(-1)) / (2 * eps)
    assert abs(analytic - numeric) <= rtol * max(1.0, abs(numeric)), (analytic, numeric)


# --- RMSNorm -----------------------------------------------------------------------------------------------------

@interpreted
@pytest.mark.parametrize("B,T,D", [(1, 1, 8), (2, 5, 37), (1, 3, 130)])
def test_rms_norm_against_oracle(B, T, D):
    x = randn(B, T, D, seed=D).requires_grad_()
    w = randn(D, seed=D + 1)
    dy = randn(B, T, D, seed=D + 2)
    y = fused.rms_norm(x, w, 1e-5)
    y.backward(dy)
    close(y, R.rms_norm(np64(x).reshape(-1, D), np64(w), 1e-5).reshape(B, T, D), "y")
    dx, _ = grads.rms_norm_backward(np64(x).reshape(-1, D), np64(w), 1e-5, np64(dy).reshape(-1, D))
    close(x.grad, dx.reshape(B, T, D), "dx")


@interpreted
def test_rms_norm_finite_difference():
    directional_check(lambda x: fused.rms_norm(x, randn(19, seed=3), 1e-5), [randn(2, 3, 19).requires_grad_()])


# --- RoPE --------------------------------------------------------------------------------------------------------

def qkv_slices(B, T, H, K, E, seed, dtype=torch.float32, device="cpu"):
    """q [B, T, H, E], k [B, T, K, E] as strided slices of one fused [B, T, (H+2K)·E] output (the trainer's case)."""
    qkv = randn(B, T, (H + 2 * K) * E, seed=seed, dtype=dtype, device=device).requires_grad_()
    q, k, _ = qkv.split([H * E, K * E, K * E], dim=-1)
    return qkv, q.view(B, T, H, E), k.view(B, T, K, E)




@interpreted
@pytest.mark.parametrize("B,T,H,K,E", [(1, 1, 2, 1, 8), (2, 5, 3, 1, 16), (1, 7, 4, 2, 64)])
def test_rope_against_oracle(B, T, H, K, E):
    qkv, q, k = qkv_slices(B, T, H, K, E, seed=T)
    cos, sin = tables(T, E)
    dq_rot, dk_rot = randn(B, T, H, E, seed=1), randn(B, T, K, E, seed=2)
    qr, kr = fused.rope_qk(q, k, cos, sin)
    torch.autograd.backward((qr, kr), (dq_rot, dk_rot))
    c, s = np64(cos), np64(sin)
    for b in range(B):
        want_q, want_k = R.rope(np64(q[b]), np64(k[b]), c, s)
        close(qr[b], want_q, "q rotated")
        close(kr[b], want_k, "k rotated")
        dq, dk = grads.rope_backward(np64(dq_rot[b]), np64(dk_rot[b]), c, s)
        g = qkv.grad[b]
        close(g[:, :H * E].view(T, H, E), dq, "dq")
        close(g[:, H * E:(H + K) * E].view(T, K, E), dk, "dk")
        assert not g[:, (H + K) * E:].any()  # v's slice: untouched by RoPE


@interpreted
def test_rope_finite_difference():
    cos, sin = tables(4, 16)
    directional_check(lambda q, k: fused.rope_qk(q, k, cos, sin),
                      [randn(2, 4, 2, 16, seed=5).requires_grad_(), randn(2, 4, 1, 16, seed=6).requires_grad_()])


# --- SwiGLU ------------------------------------------------------------------------------------------------------

@interpreted
@pytest.mark.parametrize("B,T,F", [(1, 1, 4), (2, 5, 37), (1, 3, 1500)])  # 1500: two column blocks of 1024
def test_swiglu_against_oracle(B, T, F):
    gate_up = randn(B, T, 2 * F, seed=F, scale=3.0).requires_grad_()
    dy = randn(B, T, F, seed=F + 1)
    y = fused.swiglu(gate_up)
    y.backward(dy)
    g, u = np64(gate_up)[..., :F].reshape(-1, F), np64(gate_up)[..., F:].reshape(-1, F)
    close(y, R.swiglu(g, u).reshape(B, T, F), "y")
    dg, du = grads.swiglu_backward(g, u, np64(dy).reshape(-1, F))
    close(gate_up.grad, np.concatenate([dg, du], axis=-1).reshape(B, T, 2 * F), "d gate_up")


@interpreted
@pytest.mark.parametrize("T,F", [(5, 37), (3, 1500)])
def test_swiglu_pair_against_oracle(T, F):
    """Separate gate and up (HF's MLP): the gradients come back as two tensors, each against the oracle."""
    gate, up = randn(T, F, seed=F, scale=3.0).requires_grad_(), randn(T, F, seed=F + 2).requires_grad_()
    dy = randn(T, F, seed=F + 1)
    y = fused.swiglu_pair(gate, up)
    y.backward(dy)
    close(y, R.swiglu(np64(gate), np64(up)), "y")
    dg, du = grads.swiglu_backward(np64(gate), np64(up), np64(dy))
    close(gate.grad, dg, "d gate")
    close(up.grad, du, "d up")


@interpreted
def test_swiglu_bwd_into_its_inputs_buffers():
    """swiglu_bwd writing d gate over dy and d up over up (accel/hf/mlp.py reuses its buffers): the oracle's."""
    from accel.kernels.swiglu import swiglu_bwd
    gate, up, dy = randn(5, 1500, seed=3, scale=3.0), randn(5, 1500, seed=4), randn(5, 1500, seed=5)
    dg, du = grads.swiglu_backward(np64(gate), np64(up), np64(dy))
    got_g, got_u = swiglu_bwd(gate, up, dy, dgate=dy, dup=up)
    assert got_g.data_ptr() == dy.data_ptr() and got_u.data_ptr() == up.data_ptr()
    close(got_g, dg, "d gate")
    close(got_u, du, "d up")


@interpreted
def test_swiglu_finite_difference():
    directional_check(fused.swiglu, [randn(3, 2, 22, seed=7, scale=2.0).requires_grad_()])


# --- cross-entropy -----------------------------------------------------------------------------------------------

ROWS = [
    (5, 37, [3, -100, 0, 36, -100]),  # one block, ignored rows, first and last class
    (3, 9000, [8999, 4096, -100]),  # V past the 4096-column block: the online pass over three blocks
]


@pytest.mark.parametrize("N,V,labels", ROWS)
@pytest.mark.parametrize("kernel", ["triton", "torch"])
def test_cross_entropy_rows_against_oracle(N, V, labels, kernel):
    if kernel == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU-interpreter coverage")
    logits = randn(N, V, seed=V, scale=4.0)
    want = np64(logits)
    labels_t = torch.tensor(labels)
    rows = cross_entropy_rows_(logits, labels_t) if kernel == "triton" else cross_entropy_rows_torch(logits, labels_t)
    keep = np.array(labels) != -100
    for n in range(N):  # each row's loss is the oracle's cross-entropy of that row alone (0 when ignored)
        expect = grads.cross_entropy(want[n:n + 1], np.array(labels[n:n + 1])) if keep[n] else 0.0
        assert float(rows[n]) == pytest.approx(expect, rel=1e-5, abs=1e-5)
    close(logits, grads.cross_entropy_backward(want, np.array(labels), n_labels=1), "d logits")


@pytest.mark.parametrize("kernel", [True, False])
def test_linear_cross_entropy_against_oracle(kernel):
    if kernel and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU-interpreter coverage")
    N, D, V = 7, 24, 50
    h = randn(N, D, seed=1).requires_grad_()
    w = randn(V, D, seed=2, scale=0.5)
    labels = torch.tensor([4, -100, 0, 49, 7, -100, 12])
    total = linear_cross_entropy(h, w, labels, chunk=3, use_triton=kernel)  # 3 chunks, the last one short
    n = int((labels != -100).sum())
    (total / 10).backward()  # a micro-batch of a step with 10 label tokens in all
    logits = np64(h) @ np64(w).T  # [N, D] @ [D, V] -> [N, V]
    assert float(total.detach()) == pytest.approx(grads.cross_entropy(logits, labels.numpy()) * n, rel=1e-5)
    close(h.grad, grads.cross_entropy_backward(logits, labels.numpy(), n_labels=10) @ np64(w), "dh")


def test_linear_cross_entropy_without_grad_matches():
    h, w, labels = randn(4, 8, seed=3), randn(11, 8, seed=4), torch.tensor([1, 2, -100, 10])
    with torch.no_grad():
        got = linear_cross_entropy(h, w, labels, use_triton=False)
    logits = np64(h) @ np64(w).T
    assert float(got) == pytest.approx(grads.cross_entropy(logits, labels.numpy()) * 3, rel=1e-5)


# --- GPU, bf16 at the real shapes ---------------------------------------------------------------------------------



def grads_of(fn, inputs, dys):
    outs = fn(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    gs = torch.autograd.grad(outs, inputs, dys)
    return outs, gs


@cuda
def test_gpu_bf16_norm_rope_swiglu_against_torch():
    dev = "cuda"
    x = randn(1, 2048, 2048, seed=1, device=dev, dtype=torch.bfloat16).requires_grad_()
    w = (1 + randn(2048, seed=2, device=dev, scale=0.1)).to(torch.bfloat16)
    dy = randn(1, 2048, 2048, seed=3, device=dev, dtype=torch.bfloat16)
    for (o1, g1), (o2, g2) in [(grads_of(lambda t: fused.rms_norm(t, w, 1e-5), [x], [dy]),
                                grads_of(lambda t: rms_norm(t, w, 1e-5), [x], [dy]))]:
        torch.testing.assert_close(o1[0], o2[0], **BF16)
        assert rel_l2(g1[0], g2[0]) < 1e-2
    _, q, k = qkv_slices(2, 1024, 32, 8, 64, seed=4, dtype=torch.bfloat16, device=dev)
    cos, sin = tables(1024, 64, dev)
    dq, dk = randn(*q.shape, seed=5, device=dev, dtype=torch.bfloat16), randn(*k.shape, seed=6, device=dev,
                                                                               dtype=torch.bfloat16)
    (qr1, kr1), g1 = grads_of(lambda a, b: fused.rope_qk(a, b, cos, sin), [q, k], [dq, dk])
    (qr2, kr2), g2 = grads_of(lambda a, b: (rope(a, cos, sin), rope(b, cos, sin)), [q, k], [dq, dk])
    torch.testing.assert_close(qr1, qr2, **BF16)
    torch.testing.assert_close(kr1, kr2, **BF16)
    assert rel_l2(g1[0], g2[0]) < 1e-2 and rel_l2(g1[1], g2[1]) < 1e-2
    gu = randn(1, 2048, 16384, seed=7, device=dev, dtype=torch.bfloat16, scale=2.0).requires_grad_()
    dy = randn(1, 2048, 8192, seed=8, device=dev, dtype=torch.bfloat16)
    o1, g1 = grads_of(fused.swiglu, [gu], [dy])
    o2, g2 = grads_of(swiglu, [gu], [dy])
    torch.testing.assert_close(o1[0], o2[0], **BF16)
    assert rel_l2(g1[0], g2[0]) < 1e-2


@cuda
def test_gpu_bf16_linear_cross_entropy_against_torch():
    dev = "cuda"
    h = randn(1500, 2048, seed=1, device=dev, dtype=torch.bfloat16).requires_grad_()
    w = randn(128256, 2048, seed=2, device=dev, dtype=torch.bfloat16, scale=0.02)
    labels = torch.randint(0, 128256, (1500,), device=dev)
    labels[::7] = -100
    total = linear_cross_entropy(h, w, labels)
    (gh,) = torch.autograd.grad(total / 1000, h)
    h2 = h.detach().requires_grad_()
    ref = torch.nn.functional.cross_entropy(torch.nn.functional.linear(h2, w).float(), labels, reduction="sum")
    (gh2,) = torch.autograd.grad(ref / 1000, h2)
    assert float(total) == pytest.approx(float(ref), rel=1e-3)
    assert rel_l2(gh, gh2) < 1e-2
