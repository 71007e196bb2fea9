"""accel.kernels.encoder_attn (the vision encoder's flash attention with HF's pad×pad mask) against the NumPy
oracle's encoder_attention op: CPU under Triton's interpreter (fp32, odd shapes, head dims split or padded), and on
the GPU at the real 11B encoder shape (4 tiles of 1601 tokens padded to 1608, 16 heads of 80), bf16 and fp32,
against fp64 torch. Inputs are strided views of one fused q/k/v tensor, as the encoder passes them."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from accel.kernels.encoder_attn import encoder_attention, head_split  # noqa: E402
from refimpl.model import ops as R  # noqa: E402
from refimpl.vision.encoder import padding_mask, padding_tokens  # noqa: E402

TOL = dict(rtol=1e-5, atol=2e-6)  # fp32 both sides; the interpreter's dots are exact fp32


def fused_qkv(B, L, H, E, seed, device="cpu", dtype=torch.float32):
    """q, k, v [B, L, H, E] as views of one [B·L, 3·H·E] tensor (the encoder's fused QKV GEMM output)."""
    g = torch.Generator(device=device).manual_seed(seed)
    qkv = torch.randn(B * L, 3 * H * E, device=device, generator=g).to(dtype)
    return qkv.view(B, L, 3, H, E).unbind(2)


def test_head_split():
    assert head_split(80) == (64, 16) and head_split(64)[0] == 64 and head_split(40) == (32, 16)
    assert head_split(8)[0] == 16 and head_split(100) == (64, 64)


@pytest.mark.parametrize("B,L,H,E", [(2, 45, 3, 80), (1, 40, 2, 64), (2, 33, 2, 24), (1, 70, 1, 8), (1, 17, 2, 40)])
@pytest.mark.parametrize("padded", ["none", "tokens", "tile"])
def test_matches_refimpl_op(B, L, H, E, padded):
    q, k, v = fused_qkv(B, L, H, E, seed=L * H + E)
    pad = np.zeros((B, L), bool)
    if padded == "tokens":  # a few padding tokens at the end of each "tile" of 8
        pad[:, np.arange(L) % 8 >= 6] = True
    elif padded == "tile":  # the last image's second half is a padding tile
        pad[-1, L // 2:] = True
    got = encoder_attention(q, k, v, None if padded == "none" else torch.from_numpy(pad)).numpy()
    for b in range(B):
        mask = None if padded == "none" else ~(pad[b][:, None] & pad[b][None, :])  # [L, L]
        want = R.encoder_attention(q[b].numpy(), k[b].numpy(), v[b].numpy(), mask)
        np.testing.assert_allclose(got[b], want, **TOL)


def test_padding_tokens_is_the_mask_factor():
    ar_mask = np.array([[1, 1, 0, 0], [1, 1, 1, 1]])
    pad = padding_tokens(ar_mask, 5, 8)  # [I, L]
    assert pad.shape == (2, 32) and pad[0, 16:].all() and not pad[1, :5].any() and pad[1, 5:8].all()
    assert (padding_mask(ar_mask, 5, 8) == ~(pad[:, :, None] & pad[:, None, :])).all()


def reference(q, k, v, pad):
    """fp64 softmax(q kᵀ/√E) v with pad×pad pairs blocked, a head at a time: [B, L, H, E]."""
    blocked = pad[:, :, None] & pad[:, None, :]  # [B, L, L]
    out = []
    for h in range(q.shape[2]):
        qh, kh, vh = (x[:, :, h].double() for x in (q, k, v))  # [B, L, E]
        s = qh @ kh.transpose(-1, -2) / q.shape[-1] ** 0.5  # [B, L, L]
        out.append(torch.softmax(s.masked_fill(blocked, float("-inf")), -1) @ vh)
    return torch.stack(out, dim=2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype,bound", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("tiles", [[[1, 1, 1, 1]], [[1, 1, 1, 0], [1, 1, 0, 0]]])
def test_real_shape_against_fp64(dtype, bound, tiles):
    ar_mask = np.array(tiles)
    B, L, H, E = len(tiles), 4 * 1608, 16, 80
    pad = torch.as_tensor(padding_tokens(ar_mask, 1601, 1608), device="cuda")
    q, k, v = fused_qkv(B, L, H, E, seed=B, device="cuda", dtype=dtype)
    got = encoder_attention(q, k, v, pad).double()
    want = reference(q, k, v, pad)
    assert float((got - want).abs().max() / want.abs().max()) < bound
