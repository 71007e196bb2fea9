"""The NumPy backward oracles (refimpl/train/grads.py) against central finite differences of the refimpl forwards,
in float64. NumPy only: the forwards come from refimpl.model.ops (written independently of the backwards)."""
import numpy as np
import pytest

from refimpl.model import ops
from refimpl.train import grads

RNG = np.random.default_rng(0)


def numeric_grad(loss, x, eps=1e-6):
    """d loss / d x by central differences, one element at a time (x is perturbed in place and restored)."""
    g = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        old = x[i]
        x[i] = old + eps
        up = loss()
        x[i] = old - eps
        down = loss()
        x[i] = old
        g[i] = (up - down) / (2 * eps)
    return g


def assert_grad(got, want, what):
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-8, err_msg=what)


def randn(*shape):
    return RNG.standard_normal(shape)


@pytest.mark.parametrize("T,S,H,K,causal,masked", [(5, 5, 4, 2, True, False), (4, 6, 2, 1, False, True),
                                                   (6, 6, 4, 4, True, True), (1, 1, 2, 1, True, False)])
def test_attention_backward(T, S, H, K, causal, masked):
    E = 4
    q, k, v, d_out = randn(T, H, E), randn(S, K, E), randn(S, K, E), randn(T, H, E)
    mask = RNG.random((T, S)) > 0.4 if masked else None
    if masked:
        mask[T // 2] = False  # a row that sees nothing: output 0, no gradient
    visible = grads.attention_visible(T, S, causal, mask)

    def loss():  # the forward is the refimpl's cross_attention (non-causal with a [T, S] mask), k/v as [K, S, E]
        out = ops.cross_attention(q, k.transpose(1, 0, 2), v.transpose(1, 0, 2), visible)
        return float((out * d_out).sum())

    dq, dk, dv = grads.attention_backward(q, k, v, d_out, causal, mask)
    assert_grad(dq, numeric_grad(loss, q), "dq")
    assert_grad(dk, numeric_grad(loss, k), "dk")
    assert_grad(dv, numeric_grad(loss, v), "dv")
    if masked:
        assert not dq[T // 2].any()


def test_attention_visible_is_causal_top_left():
    vis = grads.attention_visible(3, 4, True)
    assert vis.tolist() == [[True, False, False, False], [True, True, False, False], [True, True, True, False]]


def test_rms_norm_backward():
    x, w, d_out = randn(3, 8), randn(8), randn(3, 8)
    loss = lambda: float((ops.rms_norm(x, w, 1e-5) * d_out).sum())  # noqa: E731
    dx, dw = grads.rms_norm_backward(x, w, 1e-5, d_out)
    assert_grad(dx, numeric_grad(loss, x), "dx")
    assert_grad(dw, numeric_grad(loss, w), "dweight")


def test_rope_backward():
    T, E = 5, 8
    q, k, dq_rot, dk_rot = randn(T, 3, E), randn(T, 1, E), randn(T, 3, E), randn(T, 1, E)
    cos, sin = ops.rope_tables(np.arange(T) * 7, E, 500000.0, None)
    cos, sin = cos.astype(np.float64), sin.astype(np.float64)

    def loss():
        rq, rk = ops.rope(q, k, cos, sin)
        return float((rq * dq_rot).sum() + (rk * dk_rot).sum())

    dq, dk = grads.rope_backward(dq_rot, dk_rot, cos, sin)
    assert_grad(dq, numeric_grad(loss, q), "dq")
    assert_grad(dk, numeric_grad(loss, k), "dk")


def test_swiglu_backward():
    gate, up, d_out = randn(3, 7) * 3, randn(3, 7), randn(3, 7)
    loss = lambda: float((ops.swiglu(gate, up) * d_out).sum())  # noqa: E731
    dgate, dup = grads.swiglu_backward(gate, up, d_out)
    assert_grad(dgate, numeric_grad(loss, gate), "dgate")
    assert_grad(dup, numeric_grad(loss, up), "dup")


def test_lora_linear_backward():
    T, Din, Dout, R, scale = 4, 6, 5, 2, 2.5
    x, w, a, b, d_out = randn(T, Din), randn(Dout, Din), randn(R, Din), randn(Dout, R), randn(T, Dout)

    def loss():
        y = ops.linear(x, w) + scale * ops.linear(ops.linear(x, a), b)  # x Wᵀ + s (x Aᵀ) Bᵀ
        return float((y * d_out).sum())

    dx, da, db = grads.lora_linear_backward(x, w, a, b, scale, d_out)
    assert_grad(dx, numeric_grad(loss, x), "dx")
    assert_grad(da, numeric_grad(loss, a), "dA")
    assert_grad(db, numeric_grad(loss, b), "dB")


def test_cross_entropy_backward():
    logits = randn(5, 7) * 2
    labels = np.array([3, -100, 0, 6, -100])
    dlogits = grads.cross_entropy_backward(logits, labels)
    assert_grad(dlogits, numeric_grad(lambda: grads.cross_entropy(logits, labels), logits), "dlogits")
    assert not dlogits[[1, 4]].any()
    # the divisor of an accumulated step: the gradient scales by 3 / 10
    np.testing.assert_allclose(grads.cross_entropy_backward(logits, labels, n_labels=10), dlogits * 3 / 10)


def test_cross_entropy_values():
    # uniform logits: −log(1/V) per label token, whatever the label; ignored tokens count for nothing
    assert grads.cross_entropy(np.zeros((4, 8)), np.array([1, -100, 7, 0])) == pytest.approx(np.log(8))
    # one confident correct token (p = e^10 / (e^10 + 3)) and one uniform one
    logits = np.array([[10.0, 0, 0, 0], [0, 0, 0, 0]])
    want = (np.log(np.exp(10) + 3) - 10 + np.log(4)) / 2
    assert grads.cross_entropy(logits, np.array([0, 2])) == pytest.approx(want)
