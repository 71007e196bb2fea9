"""The fast encoder's LayerNorm kernels (accel.kernels.layer_norm: plain, and fused with the scaled residual add)
against the NumPy oracle's layer_norm op (CPU: Triton's interpreter, fp32, odd widths) and torch's unfused ops on the
GPU at the encoder's shape ([4·1608, 1280], bf16 and fp32). The fast encoder's self-attention
(accel.vision.encoder.self_attention: unmasked SDPA for every row, then the padding rows again under HF's pad×pad mask)
against the NumPy oracle's encoder_attention op: CPU fp32 on odd shapes and padding patterns (padding tokens, padding
tiles, images padded differently), and on the GPU at the real 11B encoder shape (4 tiles of 1601 tokens padded to 1608,
16 heads of 80), bf16 and fp32, against fp64 torch. q/k/v are one fused [I·L, 3·H·E] tensor, as the encoder's fused QKV
GEMM produces it."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

from accel.kernels.layer_norm import add_layer_norm_fwd, layer_norm_fwd  # noqa: E402
from accel.vision import encoder  # noqa: E402
from accel.vision.encoder import PaddingRows, self_attention  # noqa: E402
from refimpl.model import ops as R  # noqa: E402
from refimpl.vision.encoder import padding_mask, padding_tokens  # noqa: E402

TOL = dict(rtol=1e-5, atol=2e-6)  # fp32 both sides
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the kernels under Triton's interpreter


@pytest.mark.parametrize("T,U", [(7, 33), (3, 1280), (1, 5)])
@pytest.mark.parametrize("alpha", [None, 1.0, -0.37])
def test_layer_norm_kernels_match_refimpl(T, U, alpha):
    rng = np.random.default_rng(T * U)
    x, r = ((2 * rng.standard_normal((T, U)) + 0.7).astype(np.float32) for _ in range(2))
    w, b = rng.standard_normal(U).astype(np.float32), rng.standard_normal(U).astype(np.float32)
    tx, tr, tw, tb = (torch.from_numpy(a).to(DEVICE) for a in (x, r, w, b))
    if alpha is None:
        got = layer_norm_fwd(tx, tw, tb, 1e-5).cpu().numpy()
    else:
        x = x + np.float32(alpha) * r
        got_sum, got = (t.cpu().numpy() for t in add_layer_norm_fwd(tx, tr, alpha, tw, tb, 1e-5))
        np.testing.assert_allclose(got_sum, x, **TOL)
    np.testing.assert_allclose(got, R.layer_norm(x, w, b, 1e-5), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_norm_kernels_real_shape_against_torch(dtype):
    g = torch.Generator(device="cuda").manual_seed(3)
    x, r = (torch.randn(4 * 1608, 1280, device="cuda", generator=g).to(dtype) for _ in range(2))
    w, b = (torch.randn(1280, device="cuda", generator=g).to(dtype) for _ in range(2))
    want_sum = torch.add(x, r, alpha=0.3)
    want = F.layer_norm(want_sum, (1280,), w, b, 1e-5)
    got_sum, got = add_layer_norm_fwd(x, r, 0.3, w, b, 1e-5)
    tol = dict(rtol=1.6e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_sum, want_sum, **tol)  # fp32 sum rounded once, as torch.add (an FMA or not)
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(layer_norm_fwd(x, w, b, 1e-5), F.layer_norm(x, (1280,), w, b, 1e-5), **tol)


def fused_qkv(I, L, H, E, seed, device="cpu", dtype=torch.float32):
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(I * L, 3 * H * E, device=device, generator=g).to(dtype)  # [I·L, 3·H·E]


@pytest.mark.parametrize("tiles,P,Q,H,E", [
    ([[1, 1]], 5, 8, 3, 80),  # padding tokens only
    ([[1, 0, 0]], 9, 12, 2, 24),  # padding tiles: most rows masked
    ([[1, 1, 0], [1, 0, 0], [1, 1, 1]], 6, 8, 2, 8),  # images padded differently: rows real in some, padding in others
    ([[1, 1]], 8, 8, 4, 16),  # no padding at all
])
@pytest.mark.parametrize("few_rows", [64, 0])  # padding rows through the decode kernel, or through SDPA
def test_matches_refimpl_op(tiles, P, Q, H, E, few_rows, monkeypatch):
    monkeypatch.setattr(encoder, "FEW_ROWS", few_rows)
    ar_mask = np.array(tiles)
    I, L = len(tiles), len(tiles[0]) * Q
    qkv = fused_qkv(I, L, H, E, seed=L + E)
    got = self_attention(qkv, PaddingRows(ar_mask, P, Q, "cpu"), I, H, E).view(I, L, H, E).numpy()
    q, k, v = qkv.view(I, L, 3, H, E).unbind(2)
    visible = padding_mask(ar_mask, P, Q)  # [I, L, L], the oracle's own mask
    for i in range(I):
        want = R.encoder_attention(q[i].numpy(), k[i].numpy(), v[i].numpy(), visible[i])
        np.testing.assert_allclose(got[i], want, **TOL)


def test_padding_tokens_is_the_mask_factor():
    ar_mask = np.array([[1, 1, 0, 0], [1, 1, 1, 1]])
    pad = padding_tokens(ar_mask, 5, 8)  # [I, L]
    assert pad.shape == (2, 32) and pad[0, 16:].all() and not pad[1, :5].any() and pad[1, 5:8].all()
    assert (padding_mask(ar_mask, 5, 8) == ~(pad[:, :, None] & pad[:, None, :])).all()


def reference(q, k, v, pad):
    """fp64 softmax(q kᵀ/√E) v with pad×pad pairs blocked, a head at a time: q/k/v [I, L, H, E] -> [I, L, H, E]."""
    blocked = pad[:, :, None] & pad[:, None, :]  # [I, L, L]
    out = []
    for h in range(q.shape[2]):
        qh, kh, vh = (x[:, :, h].double() for x in (q, k, v))  # [I, L, E]
        s = qh @ kh.transpose(-1, -2) / q.shape[-1] ** 0.5  # [I, L, L]
        out.append(torch.softmax(s.masked_fill(blocked, float("-inf")), -1) @ vh)
    return torch.stack(out, dim=2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype,bound", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("tiles", [[[1, 1, 1, 1]], [[1, 1, 1, 0], [1, 1, 0, 0]]])
def test_real_shape_against_fp64(dtype, bound, tiles):
    ar_mask = np.array(tiles)
    I, L, H, E = len(tiles), 4 * 1608, 16, 80
    qkv = fused_qkv(I, L, H, E, seed=I, device="cuda", dtype=dtype)
    got = self_attention(qkv, PaddingRows(ar_mask, 1601, 1608, "cuda"), I, H, E).view(I, L, H, E).double()
    pad = torch.as_tensor(padding_tokens(ar_mask, 1601, 1608), device="cuda")
    want = reference(*qkv.view(I, L, 3, H, E).unbind(2), pad)
    assert float((got - want).abs().max() / want.abs().max()) < bound
