"""Tensor-parallel Llama 3.2 Vision on 2 GPUs over NCCL (needs 2 CUDA GPUs): TP=2 logits within bf16 tolerance of
the one-GPU engine's (accel.vision, its CUDA-graph decode step) at Llama 3.2 11B-Vision's per-layer shapes (text:
hidden 4096, 32/8 heads, MLP 14336; encoder: 560² tiles of 1601 tokens, hidden 1280) on random bf16 weights, few
layers (one cross layer between two self layers, 2 + 1 encoder layers), a prompt with text before a 4-tile image
and the same prompt without it, the prompt's last logits and two decode steps (each rank's CUDA graph)."""
from pathlib import Path

import numpy as np
import pytest
import torch

from refimpl.compare import TOLERANCES, compare
from refimpl.formats.checkpoint import load_checkpoint, save_checkpoint
from refimpl.formats.vision_checkpoint import expected_vision_shapes
from refimpl.model.vision_config import MllamaConfig
from refimpl.vision.inputs import ImageInputs
from tests._tp_harness import run_job

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                                  reason="needs CUDA: 2 GPUs")]

IMAGE = 4096
SHAPES_11B = {"model_type": "mllama", "image_token_index": IMAGE,
              "vision_config": {"image_size": 560, "num_hidden_layers": 2, "num_global_layers": 1,
                                "intermediate_layers_indices": [0, 1], "vision_output_dim": 1280 * 3},
              "text_config": {"vocab_size": IMAGE, "num_hidden_layers": 3, "cross_attention_layers": [1],
                              "max_position_embeddings": 256}}
PROMPT = [1, 900, 77, IMAGE, 31, 2000, 5, 601, 42, 3000]
DECODED = [17, 4000]


def images(cfg: MllamaConfig) -> ImageInputs:
    rng = np.random.default_rng(0)
    A, X = cfg.vision.max_num_tiles, cfg.vision.image_size
    xmask = np.zeros((len(PROMPT), 1, A), np.int64)
    xmask[PROMPT.index(IMAGE):] = 1  # the text before the image sees no tile
    return ImageInputs(rng.standard_normal((1, A, 3, X, X)).astype(np.float32),
                       np.array([cfg.vision.supported_aspect_ratios.index((2, 2)) + 1]), np.ones((1, A), np.int64),
                       xmask)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from accel.vision.weights import random_vision_weights
    cfg = MllamaConfig.from_hf(SHAPES_11B)
    w = random_vision_weights(cfg, "cuda", torch.float32, expected_vision_shapes(cfg), std=0.03)
    params = {k: v.cpu().numpy() for k, v in w.params.items()}
    del w
    torch.cuda.empty_cache()
    path = save_checkpoint(tmp_path_factory.mktemp("11bv"), cfg, params, dtype="BF16")
    im = images(cfg)
    np.savez(path / "images.npz", pixel_values=im.pixel_values, aspect_ratio_ids=im.aspect_ratio_ids,
             aspect_ratio_mask=im.aspect_ratio_mask, cross_attention_mask=im.cross_attention_mask)
    return cfg, path, im


@pytest.mark.parametrize("with_image", [True, False])
def test_tp2_logits_within_bf16_of_one_gpu(model, tmp_path, with_image):
    """The prompt (eager per shard) and each decoded token (the fused decode step, one CUDA graph a token on each
    rank, all-reduces inside) against the one-GPU engine, with the image and text-only (cross layers skipped)."""
    from accel.vision.engine import VisionAccelEngine
    cfg, path, im = model
    prompt = PROMPT if with_image else [t for t in PROMPT if t != IMAGE]
    im = im if with_image else None
    case = {"dir": str(path), "dtype": "bf16", "steps": [prompt, *[[t] for t in DECODED]],
            "capacity": len(prompt) + len(DECODED)}
    if with_image:
        case["images"] = str(path / "images.npz")
    ranks = run_job({"kind": "vision", "device": "cuda", "cases": {"m": case}}, tmp_path)
    engine = VisionAccelEngine.from_checkpoint(load_checkpoint(Path(path), with_tokenizer=False), device="cuda:0",
                                               dtype="bf16")
    sess = engine.session(len(prompt) + len(DECODED), engine.image_tokens(im))
    ref = [engine.prefill(prompt, sess, im)[0].float().cpu().numpy()]
    for n, token in enumerate(DECODED):
        step = sess.decoder.step(torch.tensor([token], device=engine.device), len(prompt) + n)
        ref.append(step[0].float().cpu().numpy())
    for i, (want, got) in enumerate(zip(ref, ranks[0]["m"]["logits"])):
        c = compare(f"step {i} logits", np.array(got), want, TOLERANCES["bf16"])
        assert c.ok, f"step {i}: max_abs {c.max_abs:.3g} (ref max {c.ref_max:.3g}) nmse {c.nmse:.3g} at {c.worst}"
    assert ranks[0]["m"]["logits"] == ranks[1]["m"]["logits"]
