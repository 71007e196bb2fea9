"""Llama 3.2 Vision in the NumPy oracle against HF transformers' MllamaForConditionalGeneration (tiny random models
built here, every gate nonzero): logits, greedy generation, the cache, text-only prompts, both key-name schemes."""
import json

import numpy as np
import pytest
import torch

from refimpl.formats.checkpoint import load_checkpoint
from refimpl.formats.params import Checkpoint
from refimpl.formats.safetensors_io import save_safetensors
from refimpl.generate import Sampling
from refimpl.generate_vision import VisionEngine
from refimpl.model import ops
from refimpl.model.llama_vision import VisionCache, forward
from refimpl.model.vision_config import MllamaConfig
from refimpl.vision.inputs import ImageInputs
from tests._mllama_hf import IMAGE, TILE, VOCAB, cross_mask, hf_config, hf_logits, hf_model, image_arrays, \
    ref_params

ATOL = 1e-4  # fp32 end to end; the bound on logits


def setup(**kw):
    model = hf_model(**kw)
    cfg = MllamaConfig.from_hf({"model_type": "mllama", **hf_config(**kw)})
    return model, cfg, ref_params(model)


def ref_logits(cfg, params, ids, images=None):
    cache = VisionCache.allocate(cfg.text, len(ids), lambda s: np.zeros(s, np.float32))
    return forward(ops, params, cfg, np.array(ids), np.arange(len(ids)), cache, images)


def inputs_for(cfg, ids, grids, seed=0):
    pixels, ar_ids, ar_mask = image_arrays(grids, seed, tile=cfg.vision.image_size)
    xmask = cross_mask(ids, [r * c for r, c in grids])
    return (pixels, ar_ids, ar_mask, xmask), ImageInputs.from_arrays(cfg.vision, pixels, ar_ids, ar_mask, xmask)


CASES = {  # name: (model settings, prompt, tile grid of each image)
    "gqa-llama3-rope-1-tile-text-before-and-after": (dict(kv_heads=2), [1, 5, 7, IMAGE, 9, 11, 13], [(1, 1)]),
    "mqa-4-tiles-image-first": (dict(kv_heads=1), [IMAGE, 1, 9, 11, 13, 17, 4], [(2, 2)]),
    "mha-default-rope-wide-and-tall": (dict(kv_heads=4, rope_scaling=False), [1, 6, IMAGE, 9, 8, IMAGE, 3, 5],
                                       [(1, 3), (2, 1)]),
    "two-adjacent-images-share-the-text": (dict(kv_heads=2, cross_layers=(0, 2)), [1, IMAGE, IMAGE, 9, 8, 7],
                                           [(4, 1), (1, 2)]),
}


def test_large_tiles_pad_like_the_real_model():
    """16×16 patches + class = 257 tokens padded to 264: 7 pad tokens a tile, as the real 560-pixel tiles' 1601 -> 1608;
    3 of 4 tiles real."""
    settings, ids, grids = dict(kv_heads=2, tile=224, text_layers=2, cross_layers=(1,)), [1, IMAGE, 9, 7], [(1, 3)]
    model, cfg, params = setup(**settings)
    assert (cfg.vision.tokens_per_tile, cfg.vision.padded_tokens_per_tile) == (257, 264)
    arrays, images = inputs_for(cfg, ids, grids)
    assert np.abs(ref_logits(cfg, params, ids, images) - hf_logits(model, ids, *arrays)).max() < ATOL


@pytest.mark.parametrize("case", CASES)
def test_logits_match_hf(case):
    settings, ids, grids = CASES[case]
    model, cfg, params = setup(**settings)
    arrays, images = inputs_for(cfg, ids, grids)
    want = hf_logits(model, ids, *arrays)
    got = ref_logits(cfg, params, ids, images)
    assert np.abs(got - want).max() < ATOL
    # the image demonstrably matters: another image moves the logits of the tokens after it
    _, other = inputs_for(cfg, ids, grids, seed=1)
    moved = np.abs(ref_logits(cfg, params, ids, other) - got).max()
    assert moved > 100 * ATOL, moved


def test_real_image_processor_layout_matches_hf():
    """pixel values, ids and mask straight from HF's MllamaImageProcessor for a wide RGB picture."""
    from PIL import Image
    from transformers import MllamaImageProcessor

    proc = MllamaImageProcessor(size={"height": TILE, "width": TILE}, max_image_tiles=4)
    picture = Image.fromarray(np.random.default_rng(3).integers(0, 255, (20, 50, 3), dtype=np.uint8))
    out = proc(images=[[picture]], return_tensors="np")
    ids = [1, 4, IMAGE, 8, 9, 10]
    model, cfg, params = setup(kv_heads=2)
    xmask = cross_mask(ids, [int(out["num_tiles"][0][0])])
    images = ImageInputs.from_arrays(cfg.vision, out["pixel_values"][0], out["aspect_ratio_ids"][0],
                                     out["aspect_ratio_mask"][0], xmask)
    assert images.aspect_ratio_mask.sum() > 1  # a multi-tile layout
    want = hf_logits(model, ids, images.pixel_values, images.aspect_ratio_ids, images.aspect_ratio_mask, xmask)
    assert np.abs(ref_logits(cfg, params, ids, images) - want).max() < ATOL


def hf_generate(model, ids, arrays=None, n=12):
    kw = {}
    if arrays is not None:
        pixels, ar_ids, ar_mask, xmask = (torch.from_numpy(a)[None] for a in arrays)
        kw = dict(pixel_values=pixels, aspect_ratio_ids=ar_ids, aspect_ratio_mask=ar_mask,
                  cross_attention_mask=xmask)
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=3, **kw)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("with_image", [True, False])
def test_twelve_greedy_tokens_match_hf_generate(with_image):
    model, cfg, params = setup(kv_heads=2)
    engine = VisionEngine(Checkpoint(None, cfg, params))
    if with_image:
        ids = [1, 5, IMAGE, 9, 11, 13, 4]
        arrays, images = inputs_for(cfg, ids, [(1, 2)])
    else:
        ids, arrays, images = [1, 5, 9, 11, 13, 4], None, None
    want = hf_generate(model, ids, arrays)
    got = list(engine.generate(ids, Sampling(max_new_tokens=12), images=images))
    assert got == want
    assert len(set(got)) > 3  # a random model that repeats one token would prove little


@pytest.mark.parametrize("image_token", [7, IMAGE, IMAGE + 3])
def test_image_token_inside_or_outside_the_vocabulary_matches_hf(image_token):
    """HF embeds image_token_index as an ordinary row of embed_tokens (vocab_size + 8 rows): a config may put it
    inside the text vocabulary (7) or on any extra row; greedy ids with an image equal HF generate's."""
    model = hf_model(kv_heads=2, image_token=image_token)
    cfg = MllamaConfig.from_hf({"model_type": "mllama", **hf_config(kv_heads=2, image_token=image_token)})
    assert cfg.image_token_index == image_token
    engine = VisionEngine(Checkpoint(None, cfg, ref_params(model)))
    ids = [1, 5, image_token, 9, 11, 13, 4]
    pixels, ar_ids, ar_mask = image_arrays([(1, 2)], 0, tile=cfg.vision.image_size)
    xmask = cross_mask(ids, [2], image_token=image_token)
    images = ImageInputs.from_arrays(cfg.vision, pixels, ar_ids, ar_mask, xmask)
    want = hf_generate(model, ids, (pixels, ar_ids, ar_mask, xmask))
    assert list(engine.generate(ids, Sampling(max_new_tokens=12), images=images)) == want
    assert len(set(want)) > 3


def test_image_token_past_the_embedding_rows_is_refused():
    with pytest.raises(Exception, match=r"image_token_index 128 must be a row of the text embedding \[0, 128\)"):
        MllamaConfig.from_hf({"model_type": "mllama", **hf_config(image_token=VOCAB + 8)}, source="config.json")


def test_no_image_prompt_matches_hf_and_skips_cross_layers():
    model, cfg, params = setup(kv_heads=1)
    ids = [1, 5, 9, 11, 13, 4]
    assert np.abs(ref_logits(cfg, params, ids) - hf_logits(model, ids)).max() < ATOL
    # skipped, not run: changing a cross-attention layer's weights changes nothing
    params = dict(params, **{"language_model.model.layers.1.mlp.down_proj.weight":
                             params["language_model.model.layers.1.mlp.down_proj.weight"] * 3})
    assert np.abs(ref_logits(cfg, params, ids) - hf_logits(model, ids)).max() < ATOL


def test_cached_decode_equals_full_forward():
    """Prefill with the image, then one token at a time from the cache (no image inputs): the same logits as one
    forward over the whole sequence, whose mask rows for generated tokens repeat the prompt's last row."""
    _, cfg, params = setup(kv_heads=2)
    ids = [1, 5, IMAGE, 9, 11]
    extra = [13, 17, 19, 23]
    (pixels, ar_ids, ar_mask, xmask), images = inputs_for(cfg, ids, [(2, 1)])
    cache = VisionCache.allocate(cfg.text, len(ids) + len(extra), lambda s: np.zeros(s, np.float32))
    steps = [forward(ops, params, cfg, np.array(ids), np.arange(len(ids)), cache, images)[-1]]
    for n, token in enumerate(extra[:-1]):
        steps.append(forward(ops, params, cfg, np.array([token]), np.array([len(ids) + n]), cache)[0])
    full_ids = ids + extra[:-1]
    full_mask = np.concatenate([xmask, np.repeat(xmask[-1:], len(extra) - 1, axis=0)])
    full = ImageInputs.from_arrays(cfg.vision, pixels, ar_ids, ar_mask, full_mask)
    want = ref_logits(cfg, params, full_ids, full)[len(ids) - 1:]
    assert np.abs(np.stack(steps) - want).max() < 1e-5


def test_both_key_name_schemes_load_and_match(tmp_path):
    model, cfg, params = setup(kv_heads=2)
    hub = tmp_path / "hub"
    model.save_pretrained(hub, max_shard_size="100KB")  # HF writes the Hub's names, sharded with an index
    assert json.loads((hub / "model.safetensors.index.json").read_text())["weight_map"]
    newer = tmp_path / "newer"
    newer.mkdir()
    (newer / "config.json").write_text((hub / "config.json").read_text())
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}  # model.language_model.*, lm_head.*
    assert any(k.startswith("model.language_model.") for k in state)
    save_safetensors(newer / "model.safetensors", state, dtype="BF16")
    ids = [1, 5, IMAGE, 9, 11]
    arrays, images = inputs_for(cfg, ids, [(1, 1)])
    a = load_checkpoint(hub, with_tokenizer=False)
    b = load_checkpoint(newer, with_tokenizer=False)
    assert isinstance(a.config, MllamaConfig) and a.config == cfg and b.config == cfg
    assert set(a.params) == set(b.params) == set(params)
    assert np.abs(ref_logits(cfg, a.params, ids, images) - hf_logits(model, ids, *arrays)).max() < ATOL
    for name in params:  # bf16 on disk: equal to the fp32 weights up to bf16 rounding
        np.testing.assert_allclose(b.params[name], params[name], rtol=2 ** -8, atol=1e-30)


def test_image_inputs_that_do_not_fit_the_prompt_or_config_are_one_line_errors():
    from refimpl.errors import GenerationError

    _, cfg, params = setup(kv_heads=2)
    engine = VisionEngine(Checkpoint(None, cfg, params))
    ids = [1, IMAGE, 9, IMAGE]
    _, one_image = inputs_for(cfg, [1, IMAGE, 9], [(1, 1)])
    cases = [
        (lambda: list(engine.generate(ids, Sampling(max_new_tokens=2), images=one_image)),
         "2 <|image|> token(s) but 1 image"),
        (lambda: list(engine.generate([1, 9], Sampling(max_new_tokens=2), images=one_image)),
         "0 <|image|> token(s) but 1 image"),
        (lambda: list(engine.generate([1, IMAGE, 9, 8], Sampling(max_new_tokens=2), images=one_image)),
         "cross_attention_mask has 3 rows for a prompt of 4 tokens"),
        (lambda: ImageInputs.from_arrays(cfg.vision, np.zeros((1, 4, 3, 14, 14)), [1], [[1, 0, 0, 0]]),
         r"pixel_values has shape \[1, 4, 3, 14, 14\], expected \[images, 4, 3, 28, 28\]"),
        (lambda: ImageInputs.from_arrays(cfg.vision, one_image.pixel_values, [9], [[1, 0, 0, 0]]),
         r"aspect_ratio_ids must be 1 ids in \[1, 8\]"),
    ]
    for call, message in cases:
        with pytest.raises(GenerationError, match=message):
            call()
