"""tools/bench/agreement.py's vision mode on CPU in fp32: the accel engine must agree with the refimpl at every
teacher-forced step (both fp32: only summation order differs), and its tiny random model must really use its
image (every gate nonzero) — else the benchmark's bf16 figure would measure a text model."""
import numpy as np
import pytest

pytest.importorskip("torch")
from refimpl.formats.params import Checkpoint  # noqa: E402
from refimpl.generate_vision import VisionEngine  # noqa: E402
from refimpl.model.vision_config import MllamaConfig  # noqa: E402
from tools.bench import agreement  # noqa: E402
from tools.vision_toy import random_vision_params, toy_vision_config  # noqa: E402


def test_vision_agreement_fp32_is_total():
    r = agreement.vision_agreement(steps=24, prompt_tokens=12, dtype="fp32", device="cpu", use_triton=False)
    assert r["model"] == "vision-tiny" and r["steps"] == 24 and r["accel_dtype"] == "fp32"
    assert r["top1_agreement"] == 1.0 and r["disagreements"] == 0
    assert r["free_running_shared_prefix"] == 24


@pytest.mark.parametrize("model", ["vision-tiny", "toy-vision"])
def test_random_vision_model_sees_its_image_and_every_gate_is_open(model):
    """Both random vision models' draw (tools.vision_toy.random_vision_params): each tanh gate, the cross layers'
    too, open and unsaturated with both signs present, and another image changes the logits."""
    cfg = MllamaConfig.from_hf(agreement.VISION_TINY) if model == "vision-tiny" else toy_vision_config()
    params = random_vision_params(cfg)
    gates = [v.item() for k, v in params.items() if v.shape == (1,)]
    # the position embeddings' 3, each global layer's 2, each cross layer's 2
    assert len(gates) == 3 + 2 * cfg.vision.num_global_layers + 2 * len(cfg.text.cross_attention_layers)
    assert all(0.3 <= abs(g) <= 1.2 for g in gates) and min(gates) < 0 < max(gates)
    ref = VisionEngine(Checkpoint(None, cfg, params))
    ids, images = agreement.vision_inputs(cfg, 12)
    with_image = ref.logits(ids, np.arange(len(ids)), ref.new_cache(len(ids)), images=images)
    other = images.pixel_values.copy()
    other[:, 1:] = 0  # another image: only its first tile kept
    changed = ref.logits(ids, np.arange(len(ids)), ref.new_cache(len(ids)),
                         images=type(images)(other, images.aspect_ratio_ids, images.aspect_ratio_mask,
                                             images.cross_attention_mask))
    assert np.abs(with_image - changed).max() > 0.1 * with_image.std()
