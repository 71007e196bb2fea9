"""The vision ops (`refimpl.model.interface.VisionOps`): refimpl against accel (plain torch, CPU fp32) on odd shapes,
and the refimpl against torch's own LayerNorm / GELU definitions."""
import inspect

import numpy as np
import pytest

from refimpl.model import interface
from refimpl.model import ops as R

torch = pytest.importorskip("torch")
from accel import ops as A  # noqa: E402

TOL = dict(rtol=1.3e-6, atol=1e-5)  # torch.testing's fp32 defaults: both sides compute in fp32


def t(x):
    return torch.from_numpy(np.ascontiguousarray(x))


@pytest.mark.parametrize("op", interface.VISION_OP_NAMES)
def test_both_backends_have_the_protocol_signature(op):
    want = [p.name for p in inspect.signature(getattr(interface.VisionOps, op)).parameters.values()][1:]
    for module in (R, A):
        assert isinstance(module, interface.VisionOps)
        assert [p.name for p in inspect.signature(getattr(module, op)).parameters.values()] == want


@pytest.mark.parametrize("shape", [(7, 33), (3, 5, 17), (1, 1)])
def test_layer_norm(shape):
    rng = np.random.default_rng(sum(shape))
    x = (3 * rng.standard_normal(shape) + 1.5).astype(np.float32)
    w, b = rng.standard_normal(shape[-1:]).astype(np.float32), rng.standard_normal(shape[-1:]).astype(np.float32)
    got = R.layer_norm(x, w, b, 1e-5)
    np.testing.assert_allclose(got, A.layer_norm(t(x), t(w), t(b), 1e-5).numpy(), **TOL)
    ln = torch.nn.LayerNorm(shape[-1], eps=1e-5)
    with torch.no_grad():
        ln.weight.copy_(t(w)), ln.bias.copy_(t(b))
        np.testing.assert_allclose(got, ln(t(x)).numpy(), **TOL)


@pytest.mark.parametrize("shape", [(5, 37), (2, 3, 129)])
def test_gelu_is_the_exact_erf_form(shape):
    x = (4 * np.random.default_rng(1).standard_normal(shape)).astype(np.float32)
    got = R.gelu(x)
    np.testing.assert_allclose(got, A.gelu(t(x)).numpy(), **TOL)
    tanh_form = torch.nn.functional.gelu(t(x), approximate="tanh").numpy()
    assert np.abs(got - tanh_form).max() > 1e-4  # the test can tell the two forms apart


@pytest.mark.parametrize("L,H,K,E", [(13, 4, 4, 8), (24, 6, 2, 5), (9, 3, 1, 16), (1100, 2, 1, 3), (40, 3, 3, 80)])
@pytest.mark.parametrize("masked", [False, True])
def test_encoder_attention(L, H, K, E, masked):
    rng = np.random.default_rng(L * H + E)
    q = rng.standard_normal((L, H, E)).astype(np.float32)
    k, v = (rng.standard_normal((L, K, E)).astype(np.float32) for _ in range(2))
    mask = None
    if masked:  # the vision encoder's shape of mask: each tile's tokens padded to a multiple of 8, pad×pad blocked
        pad = (np.arange(L) % 8 >= 5) if L % 8 == 0 else np.arange(L) >= L - 3
        mask = ~(pad[:, None] & pad[None, :])
    got = R.encoder_attention(q, k, v, mask)
    np.testing.assert_allclose(got, A.encoder_attention(t(q), t(k), t(v), None if mask is None else t(mask)).numpy(),
                               **TOL)
    # against a plain softmax(q kᵀ/√E) v with the GQA head mapping spelled out
    scores = np.einsum("lhe,mhe->hlm", q, np.repeat(k, H // K, axis=1)) / np.sqrt(E)
    if mask is not None:
        scores = np.where(mask, scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    want = np.einsum("hlm,mhe->lhe", p / p.sum(-1, keepdims=True), np.repeat(v, H // K, axis=1))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
