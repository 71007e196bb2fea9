"""Llama 3.2 Vision on accel against the NumPy oracle (refimpl.generate_vision.VisionEngine), CPU fp32, tiny random
models from tests/_mllama_hf.py (every gate nonzero): the fast path's prefill and decode logits, greedy ids, trace
mode's names and values, and prompts without an image."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from accel.vision.engine import VisionAccelEngine  # noqa: E402
from accel import ops  # noqa: E402
from refimpl.formats.params import Checkpoint  # noqa: E402
from refimpl.generate import Sampling  # noqa: E402
from refimpl.generate_vision import VisionEngine  # noqa: E402
from refimpl.model import ops as R  # noqa: E402
from refimpl.model.vision_config import MllamaConfig  # noqa: E402
from refimpl.model.names import vision_activation_names  # noqa: E402
from refimpl.vision.inputs import ImageInputs  # noqa: E402
from tests._mllama_hf import IMAGE, cross_mask, hf_config, image_arrays  # noqa: E402

ATOL = 1e-4  # fp32 on both sides; the same bound the oracle meets against HF


def models(seed=0, use_triton=None, **kw):
    """(refimpl engine, accel engine) over the same random HF-initialised checkpoint (every gate nonzero);
    use_triton None: the kernels under Triton's interpreter where conftest turns it on, False: torch ops."""
    from tests._mllama_hf import hf_model, ref_params
    cfg = MllamaConfig.from_hf({"model_type": "mllama", **hf_config(**kw)})
    ckpt = Checkpoint(None, cfg, ref_params(hf_model(seed, **kw)))
    return VisionEngine(ckpt), VisionAccelEngine.from_checkpoint(ckpt, device="cpu", dtype="fp32",
                                                                 use_triton=use_triton)


def images_for(cfg, ids, grids, seed=0):
    pixels, ar_ids, ar_mask = image_arrays(grids, seed, tile=cfg.vision.image_size)
    return ImageInputs.from_arrays(cfg.vision, pixels, ar_ids, ar_mask, cross_mask(ids, [r * c for r, c in grids]))


CASES = {  # name: (model settings, prompt, tile grids)
    "gqa-1-tile-text-before-and-after": (dict(kv_heads=2), [1, 5, 7, IMAGE, 9, 11, 13], [(1, 1)]),
    "mqa-4-tiles-image-first": (dict(kv_heads=1), [IMAGE, 1, 9, 11, 13, 17, 4], [(2, 2)]),
    "mha-two-images-3-and-2-tiles": (dict(kv_heads=4, rope_scaling=False), [1, 6, IMAGE, 9, 8, IMAGE, 3, 5],
                                     [(1, 3), (2, 1)]),
    "cross-layer-first": (dict(kv_heads=2, cross_layers=(0, 2)), [1, IMAGE, 9, 8, 7], [(4, 1)]),
}


@pytest.mark.parametrize("case", CASES)
def test_fast_prefill_and_decode_match_refimpl(case):
    kw, ids, grids = CASES[case]
    ref, acc = models(**kw)
    images = images_for(ref.config, ids, grids)
    got, want = prefill_and_decode(ref, acc, ids, images, extra=[13, 4])
    np.testing.assert_allclose(got, want, rtol=0, atol=ATOL)
    # the image matters: without it (and no cross layers) the logits differ
    text_only = [t for t in ids if t != IMAGE]
    other = ref.logits(text_only, np.arange(len(text_only)), ref.new_cache(len(text_only)))
    assert np.abs(other - want[0]).max() > 1e-2


def prefill_and_decode(ref, acc, ids, images, extra):
    """(accel, refimpl) logits [1 + len(extra), V]: the prompt with its images, then `extra` one token at a time
    (accel: its decode step, the CUDA graph on GPU)."""
    cache = ref.new_cache(len(ids) + len(extra))
    want = [ref.logits(ids, np.arange(len(ids)), cache, images=images)]
    for n, token in enumerate(extra):
        want.append(ref.logits([token], [len(ids) + n], cache))
    sess = acc.session(len(ids) + len(extra), acc.image_tokens(images))
    got = [acc.prefill(ids, sess, images)[0]]
    for n, token in enumerate(extra):
        got.append(sess.decoder.step(torch.tensor([token], device=acc.device), len(ids) + n)[0].clone())
    return np.stack([acc.to_numpy(g) for g in got]), np.stack(want)


@pytest.mark.parametrize("with_image", [True, False])
def test_greedy_ids_equal_refimpl(with_image):
    ref, acc = models(kv_heads=2, use_triton=False)  # the interpreted kernels are covered above; this is the loop
    ids = [1, 5, IMAGE, 9, 11, 13, 4] if with_image else [1, 5, 9, 11, 13, 4]
    images = images_for(ref.config, ids, [(1, 2)]) if with_image else None
    s = Sampling(max_new_tokens=8)
    want = list(ref.generate(ids, s, images=images))
    assert list(acc.generate(ids, s, images=images)) == want
    assert len(set(want)) > 3


def test_no_image_prompt_has_no_image_buffers_and_skips_cross_layers():
    ref, acc = models(kv_heads=1)
    ids = [1, 5, 9, 11, 13, 4]
    sess = acc.session(len(ids) + 2, acc.image_tokens(None))
    assert sess.cache.xk_all is None and sess.cache.xv_all is None
    logits = acc.to_numpy(acc.prefill(ids, sess))[0]
    np.testing.assert_allclose(logits, ref.logits(ids, np.arange(len(ids)), ref.new_cache(len(ids))), atol=ATOL)
    # a cross layer's weights do not matter without an image
    acc.params["language_model.model.layers.1.mlp.down_proj.weight"].mul_(3)
    np.testing.assert_allclose(acc.to_numpy(acc.prefill(ids, sess))[0], logits, atol=1e-6)


def test_trace_mode_names_and_values_match_refimpl():
    ref, acc = models(kv_heads=2)
    ids = [1, 5, IMAGE, 9, 11]
    images = images_for(ref.config, ids, [(2, 2)])
    rc, ac = ref.new_cache(len(ids) + 1), acc.new_cache(len(ids) + 1)
    want = list(ref.steps(ids, np.arange(len(ids)), rc, images=images))
    got = list(acc.steps(ids, np.arange(len(ids)), ac, images=images))
    names = vision_activation_names(ref.config, encode_images=True)
    assert [n for n, _ in got] == [n for n, _ in want] == names
    for (name, w), (_, g) in zip(want, got):
        np.testing.assert_allclose(acc.to_numpy(g), w, rtol=1e-4, atol=1e-4, err_msg=name)
    # a decode step reads the image keys/values from the cache
    want = list(ref.steps([7], [len(ids)], rc))
    got = list(acc.steps([7], [len(ids)], ac))
    assert [n for n, _ in got] == vision_activation_names(ref.config, encode_images=False, image_in_cache=True)
    np.testing.assert_allclose(acc.to_numpy(got[-1][1]), want[-1][1], atol=ATOL)


@pytest.mark.parametrize("path", ["triton", "torch"])
@pytest.mark.parametrize("T,H,K,E,N", [(7, 4, 2, 8, 37), (1, 8, 1, 80, 37), (5, 6, 3, 5, 20), (1, 4, 2, 16, 150)])
def test_norm_cross_attention_matches_refimpl(path, T, H, K, E, N):
    """q_norm + the cross-attention op of refimpl, rows seeing scattered keys (whole blocks hidden from a row
    included); the decode kernel (T = 1: several splits) and the flash kernel (T > 1)."""
    rng = np.random.default_rng(T + N)
    q = rng.standard_normal((T, H, E)).astype(np.float32)
    k, v = (rng.standard_normal((K, N, E)).astype(np.float32) for _ in range(2))
    w = (1 + 0.3 * rng.standard_normal(E)).astype(np.float32)
    visible = rng.random((T, N)) < 0.3
    visible[:, : N // 2] = False  # the first blocks hide every key: the online softmax starts from -inf
    visible[:, -1] = True
    want = R.cross_attention(R.rms_norm(q, w, 1e-5), k, v, visible)
    with ops.torch_only(path == "torch"):
        got = ops.norm_cross_attention(*(torch.from_numpy(a) for a in (q, w)), 1e-5,
                                       *(torch.from_numpy(a) for a in (k, v, visible)))
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)


def test_bench_builds_random_weights_hf_can_hold():
    """The benchmark's random real-shape weights (here at a tiny config) cover every checkpoint tensor, and
    HF's model built from them computes what the engine computes (bf16 both, CPU)."""
    from refimpl.formats.vision_checkpoint import expected_vision_shapes
    from accel.vision.weights import random_vision_weights
    from tools.bench.vision import hf_model
    cfg = MllamaConfig.from_hf({"model_type": "mllama", **hf_config(kv_heads=2)})
    shapes = expected_vision_shapes(cfg)
    w = random_vision_weights(cfg, "cpu", torch.bfloat16, shapes, std=0.2)
    assert {k: tuple(v.shape) for k, v in w.params.items()} == shapes
    params = {k: v.float().numpy() for k, v in w.params.items()}  # the same values in fp32 on both sides
    acc = VisionAccelEngine.from_checkpoint(Checkpoint(None, cfg, params), device="cpu", dtype="fp32")
    ids = [1, 5, IMAGE, 9, 11]
    images = images_for(cfg, ids, [(2, 2)])
    sess = acc.session(len(ids), acc.image_tokens(images))
    got = acc.to_numpy(acc.prefill(ids, sess, images))[0]
    model = hf_model(cfg, w.params, "cpu").float()
    from tests._mllama_hf import hf_logits
    want = hf_logits(model, ids, images.pixel_values, images.aspect_ratio_ids, images.aspect_ratio_mask,
                     images.cross_attention_mask)[-1]
    np.testing.assert_allclose(got, want, atol=ATOL)


def test_engine_for_picks_the_mllama_engine_for_accel():
    from tools.engines import engine_for
    ref, _ = models(kv_heads=2, use_triton=False)
    assert isinstance(engine_for(ref.ckpt, "accel", "cpu", "fp32"), VisionAccelEngine)
