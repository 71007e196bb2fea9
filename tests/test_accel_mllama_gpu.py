"""Llama 3.2 Vision on accel on the GPU at the real per-layer shapes (tiles of 560² -> 1600 + 1 patches padded to
1608, 16 encoder heads of 80, text 32/8 heads of 128, hidden 4096; few layers), bf16 and fp32, against the NumPy
oracle on the same weights and the attention paths against fp64 torch. Skipped without CUDA."""
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
from tests.test_accel_mllama import prefill_and_decode  # noqa: E402

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


@pytest.mark.parametrize("dtype,bound,top1", [("fp32", 3e-3, 1.0), ("bf16", 6e-2, 0.5)])  # bf16: near-ties flip
@pytest.mark.parametrize("tiles", [1, 4])
def test_fast_path_matches_refimpl_at_real_shapes(model, dtype, bound, top1, tiles):
    cfg, ckpt = model
    ref = VisionEngine(ckpt)
    acc = VisionAccelEngine.from_checkpoint(ckpt, device="cuda", dtype=dtype)
    ids = [1, 5, 7, IMAGE, 9, 11, 13, 17, 19, 23]
    images = images_for(cfg, ids, tiles)
    got, want = prefill_and_decode(ref, acc, ids, images, extra=[29, 31, 37])  # decode: the CUDA graph
    assert rel(got, want) < bound
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= top1


def test_trace_mode_names_at_real_shapes_bf16(model):
    cfg, ckpt = model
    acc = VisionAccelEngine.from_checkpoint(ckpt, device="cuda", dtype="bf16")
    ref = VisionEngine(ckpt)
    ids = [1, IMAGE, 9, 11]
    images = images_for(cfg, ids, 2)
    got = list(acc.steps(ids, np.arange(len(ids)), acc.new_cache(len(ids)), images=images))
    assert [n for n, _ in got] == vision_activation_names(cfg, encode_images=True)
    want = ref.logits(ids, np.arange(len(ids)), ref.new_cache(len(ids)), images=images)
    assert rel(acc.to_numpy(got[-1][1])[-1], want) < 6e-2


@pytest.mark.parametrize("dtype,bound", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_encoder_attention_real_shape_against_fp64(dtype, bound):
    """4 tiles of 1601 tokens padded to 1608, 16 heads of 80, HF's pad×pad mask: the fast encoder's SDPA call."""
    import torch.nn.functional as F
    L, H, E = 4 * 1608, 16, 80
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, H, L, E, device="cuda", generator=g) for _ in range(3))
    mask = torch.as_tensor(padding_mask(np.array([[1, 1, 1, 0]]), 1601, 1608), device="cuda")[:, None]
    got = F.scaled_dot_product_attention(q.to(dtype), k.to(dtype), v.to(dtype), attn_mask=mask).double()
    s = (q.double() @ k.double().transpose(-1, -2)) / E ** 0.5
    want = torch.softmax(s.masked_fill(~mask, float("-inf")), -1) @ v.double()
    assert float((got - want).abs().max() / want.abs().max()) < bound


@pytest.mark.parametrize("path", ["triton", "torch"])
@pytest.mark.parametrize("T", [1, 37])
@pytest.mark.parametrize("dtype,bound", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_norm_cross_attention_real_shape_against_fp64(path, T, dtype, bound):
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
