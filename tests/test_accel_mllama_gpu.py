"""Llama 3.2 Vision on accel on the GPU at the real per-layer shapes (tiles of 560² -> 1600 + 1 patches padded to
1608, 16 encoder heads of 80, text 32/8 heads of 128, hidden 4096; few layers), bf16 and fp32, against the NumPy
oracle on the same weights, and trace mode's attention ops against fp64 torch (the fast encoder's self-attention:
tests/test_accel_encoder.py). Skipped without CUDA.

fp32 is held to the CPU twin's bound (tests/test_accel_mllama.py: 1e-4 absolute) with TF32 off; bf16 to
refimpl.compare's bf16 bound, its greedy choice equal to the oracle's on every row but a near-tie (tests/_logits.py)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from accel.vision.engine import VisionAccelEngine  # noqa: E402
from accel import ops  # noqa: E402
from accel.vision.weights import random_vision_weights  # noqa: E402
from refimpl.formats.vision_checkpoint import expected_vision_shapes  # noqa: E402
from refimpl.formats.params import Checkpoint  # noqa: E402
from refimpl.generate_vision import VisionEngine  # noqa: E402
from refimpl.model.vision_config import MllamaConfig  # noqa: E402
from refimpl.model.names import vision_activation_names  # noqa: E402
from refimpl.vision.encoder import padding_mask  # noqa: E402
from refimpl.vision.inputs import ImageInputs  # noqa: E402
from refimpl.compare import TOLERANCES  # noqa: E402
from tests._logits import unexplained_flips  # noqa: E402
from tests.test_accel_mllama import ATOL, prefill_and_decode  # noqa: E402

IMAGE = 512
REAL = {"model_type": "mllama", "image_token_index": IMAGE,
        "vision_config": {"image_size": 560, "num_hidden_layers": 2, "num_global_layers": 1,
                          "intermediate_layers_indices": [0, 1], "vision_output_dim": 1280 * 3},
        "text_config": {"vocab_size": IMAGE, "num_hidden_layers": 3, "cross_attention_layers": [1],
                        "max_position_embeddings": 512}}


@pytest.fixture(scope="module")
def model():
    cfg = MllamaConfig.from_hf(REAL)
    w = random_vision_weights(cfg, "cuda", torch.float32, expected_vision_shapes(cfg), std=0.03)
    params = {k: v.cpu().numpy() for k, v in w.params.items()}
    del w
    return cfg, Checkpoint(None, cfg, params)


def images_for(cfg, ids, tiles: int, seed=0):
    rng = np.random.default_rng(seed)
    A, X = cfg.vision.max_num_tiles, cfg.vision.image_size
    pixels = np.zeros((1, A, 3, X, X), np.float32)
    pixels[0, :tiles] = rng.standard_normal((tiles, 3, X, X))
    ratio = {1: (1, 1), 2: (1, 2), 4: (2, 2)}[tiles]
    mask = np.zeros((1, A), np.int64)
    mask[0, :tiles] = 1
    start = ids.index(IMAGE)
    xmask = np.zeros((len(ids), 1, A), np.int64)
    xmask[start:, 0, :tiles] = 1
    return ImageInputs.from_arrays(cfg.vision, pixels, [cfg.vision.supported_aspect_ratios.index(ratio) + 1], mask,
                                   xmask)


def rel(got, want):
    return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.fixture
def no_tf32():
    """IEEE fp32 GEMMs and convolutions whatever the process default (TF32 rounds inputs to 10 mantissa bits)."""
    flags = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("tiles", [1, 4])
def test_fast_path_matches_refimpl_at_real_shapes(model, no_tf32, dtype, tiles):
    cfg, ckpt = model
    ref = VisionEngine(ckpt)
    acc = VisionAccelEngine.from_checkpoint(ckpt, device="cuda", dtype=dtype)
    ids = [1, 5, 7, IMAGE, 9, 11, 13, 17, 19, 23]
    images = images_for(cfg, ids, tiles)
    got, want = prefill_and_decode(ref, acc, ids, images, extra=[29, 31, 37])  # decode: the CUDA graph
    if dtype == "fp32":
        np.testing.assert_allclose(got, want, rtol=0, atol=ATOL)
        assert (got.argmax(-1) == want.argmax(-1)).all()
    else:
        assert rel(got, want) < TOLERANCES["bf16"].max_rel
        assert not unexplained_flips(got, want), unexplained_flips(got, want)


def test_trace_mode_names_at_real_shapes_bf16(model):
    cfg, ckpt = model
    acc = VisionAccelEngine.from_checkpoint(ckpt, device="cuda", dtype="bf16")
    ref = VisionEngine(ckpt)
    ids = [1, IMAGE, 9, 11]
    images = images_for(cfg, ids, 2)
    got = list(acc.steps(ids, np.arange(len(ids)), acc.new_cache(len(ids)), images=images))
    assert [n for n, _ in got] == vision_activation_names(cfg, encode_images=True)
    want = ref.logits(ids, np.arange(len(ids)), ref.new_cache(len(ids)), images=images)
    assert rel(acc.to_numpy(got[-1][1])[-1], want) < TOLERANCES["bf16"].max_rel


def encoder_attention64(q, k, v, visible):
    """fp64 softmax(q kᵀ/√E) v over the visible pairs, a head at a time (one [L, L] fp64 score matrix at once):
    q/k/v [L, H, E], visible [L, L] -> [L, H, E]."""
    out = []
    for h in range(q.shape[1]):
        qh, kh, vh = (x[:, h].double() for x in (q, k, v))  # [L, E]
        s = qh @ kh.T / q.shape[-1] ** 0.5  # [L, E] @ [E, L] -> [L, L]
        out.append(torch.softmax(s.masked_fill_(~visible, float("-inf")), -1) @ vh)  # [L, L] @ [L, E]
        del s
    return torch.stack(out, dim=1)


@pytest.mark.parametrize("dtype,bound", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_encoder_attention_real_shape_against_fp64(no_tf32, dtype, bound):
    """accel.ops.encoder_attention (trace mode's op over refimpl's encoder) on one image of 4 tiles of 1601 tokens
    padded to 1608, the last tile a padding tile, 16 heads of 80, HF's pad×pad mask."""
    L, H, E = 4 * 1608, 16, 80
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(L, H, E, device="cuda", generator=g).to(dtype) for _ in range(3))
    visible = torch.as_tensor(padding_mask(np.array([[1, 1, 1, 0]]), 1601, 1608)[0], device="cuda")  # [L, L]
    assert not visible.all()  # pad×pad pairs are blocked
    got = ops.encoder_attention(q, k, v, visible)
    assert got.shape == (L, H, E) and got.dtype == dtype
    want = encoder_attention64(q, k, v, visible)
    assert float((got.double() - want).abs().max() / want.abs().max()) < bound


@pytest.mark.parametrize("path", ["triton", "torch"])
@pytest.mark.parametrize("T", [1, 37])
@pytest.mark.parametrize("dtype,bound", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_norm_cross_attention_real_shape_against_fp64(no_tf32, path, T, dtype, bound):
    """4 tiles of 1601 image tokens, the last tile hidden (a padded tile), 32/8 heads of 128."""
    H, K, E, N = 32, 8, 128, 4 * 1601
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(T, H, E, device="cuda", generator=g)
    w = 1 + 0.1 * torch.randn(E, device="cuda", generator=g)
    k, v = (torch.randn(K, N, E, device="cuda", generator=g) for _ in range(2))
    visible = torch.rand(T, N, device="cuda", generator=g) < 0.5
    visible[:, 3 * 1601:] = False
    visible[:, 0] = True
    with ops.torch_only(path == "torch"):
        got = ops.norm_cross_attention(q.to(dtype), w.to(dtype), 1e-5, k.to(dtype), v.to(dtype), visible).double()
    qd = q.to(dtype).double()  # the normed query from the rounded input, as the kernel sees it
    qn = qd * torch.rsqrt(qd.pow(2).mean(-1, keepdim=True) + 1e-5) * w.to(dtype).double()
    kk, vv = k.double().repeat_interleave(H // K, 0), v.double().repeat_interleave(H // K, 0)  # [H, N, E]
    s = torch.einsum("the,hne->htn", qn, kk) / E ** 0.5
    want = torch.einsum("htn,hne->the", torch.softmax(s.masked_fill(~visible, float("-inf")), -1), vv)
    assert float((got - want).abs().max() / want.abs().max()) < bound
