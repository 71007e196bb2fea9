"""The activation-name scheme is pinned: golden files, CLI filters and reports all rely on this exact order."""
import numpy as np

from refimpl.model import ops
from refimpl.formats.params import random_params
from refimpl.model.config import LlamaConfig
from refimpl.model.llama import KVCache, forward, forward_steps
from refimpl.model.names import activation_names, matches, split_name

EXPECTED_TWO_LAYERS = [
    "embed",
    "layers.0.attn_norm", "layers.0.attn.q", "layers.0.attn.k", "layers.0.attn.v", "layers.0.attn.q_rot",
    "layers.0.attn.k_rot", "layers.0.attn.out", "layers.0.attn.o_proj", "layers.0.resid_mid", "layers.0.mlp_norm",
    "layers.0.mlp.gate", "layers.0.mlp.up", "layers.0.mlp.act", "layers.0.mlp.down", "layers.0.resid_post",
    "layers.1.attn_norm", "layers.1.attn.q", "layers.1.attn.k", "layers.1.attn.v", "layers.1.attn.q_rot",
    "layers.1.attn.k_rot", "layers.1.attn.out", "layers.1.attn.o_proj", "layers.1.resid_mid", "layers.1.mlp_norm",
    "layers.1.mlp.gate", "layers.1.mlp.up", "layers.1.mlp.act", "layers.1.mlp.down", "layers.1.resid_post",
    "final_norm", "logits",
]

CFG = LlamaConfig(vocab_size=50, hidden_size=24, intermediate_size=40, num_hidden_layers=2, num_attention_heads=6,
                  num_key_value_heads=2, head_dim=8)


def test_exact_ordered_list():
    assert activation_names(2) == EXPECTED_TWO_LAYERS


def test_forward_yields_exactly_the_scheme_with_documented_shapes():
    params = random_params(CFG)
    cache = KVCache.allocate(CFG, 8, lambda s: np.zeros(s, np.float32))
    seen = list(forward_steps(ops, params, CFG, np.array([3, 4, 5]), np.arange(3), cache))
    assert [n for n, _ in seen] == EXPECTED_TWO_LAYERS
    shapes = dict((n, v.shape) for n, v in seen)
    T, D, F, H, K, E, V = 3, 24, 40, 6, 2, 8, 50
    assert shapes["embed"] == (T, D) and shapes["logits"] == (T, V)
    assert shapes["layers.1.attn.q_rot"] == (T, H, E) and shapes["layers.1.attn.k"] == (T, K, E)
    assert shapes["layers.0.attn.out"] == (T, H, E) and shapes["layers.0.mlp.act"] == (T, F)


def test_sent_value_replaces_activation():
    """A value sent back into the generator is what the rest of the forward consumes (the debugger relies on it)."""
    params = random_params(CFG)
    ids, pos = np.array([3, 4]), np.arange(2)
    new_cache = lambda: KVCache.allocate(CFG, 4, lambda s: np.zeros(s, np.float32))  # noqa: E731
    plain = forward(ops, params, CFG, ids, pos, new_cache())
    steps = forward_steps(ops, params, CFG, ids, pos, new_cache())
    name, value = next(steps)
    while name != "layers.1.mlp.down":
        name, value = steps.send(None)
    try:
        steps.send(np.zeros_like(value))
        while True:
            next(steps)
    except StopIteration as stop:
        patched = stop.value
    assert not np.allclose(plain, patched)


def test_filters_and_split():
    assert matches("layers.7.attn.q", ["layers.7.attn.*"]) and not matches("layers.7.mlp.up", ["layers.7.attn.*"])
    assert matches("anything", [])
    assert split_name("layers.12.mlp.act") == (12, "mlp.act") and split_name("logits") == (None, "logits")


# ---- Llama 3.2 Vision: one local + one global encoder layer, two text layers with cross-attention at layer 1 ----

VISION_LAYER = ["attn_norm", "attn.q", "attn.k", "attn.v", "attn.out", "attn.o_proj", "resid_mid", "mlp_norm",
                "mlp.fc1", "mlp.act", "mlp.fc2", "resid_post"]
EXPECTED_VISION = (
    ["vision.patch_embed", "vision.pre_tile", "vision.pos_embed", "vision.layernorm_pre"]
    + [f"vision.layers.0.{a}" for a in VISION_LAYER]
    + ["vision.layernorm_post", "vision.post_tile"]
    + [f"vision.global.0.{a}" for a in VISION_LAYER]
    + ["vision.out", "projector"]
)
SELF_LAYER_0 = EXPECTED_TWO_LAYERS[1:16]
CROSS_LAYER_1 = [
    "layers.1.xattn_norm", "layers.1.xattn.q", "layers.1.xattn.q_norm", "layers.1.xattn.k", "layers.1.xattn.k_norm",
    "layers.1.xattn.v", "layers.1.xattn.out", "layers.1.xattn.o_proj", "layers.1.resid_mid", "layers.1.mlp_norm",
    "layers.1.mlp.gate", "layers.1.mlp.up", "layers.1.mlp.act", "layers.1.mlp.down", "layers.1.resid_post",
]
IMAGE_KV = {"layers.1.xattn.k", "layers.1.xattn.k_norm", "layers.1.xattn.v"}
EXPECTED_MLLAMA = {  # mode: names
    "prompt with images": EXPECTED_VISION + ["embed"] + SELF_LAYER_0 + CROSS_LAYER_1 + ["final_norm", "logits"],
    "decode after images": ["embed"] + SELF_LAYER_0 + [n for n in CROSS_LAYER_1 if n not in IMAGE_KV]
    + ["final_norm", "logits"],
    "no image": ["embed"] + SELF_LAYER_0 + ["final_norm", "logits"],
}


def _mllama():
    from refimpl.formats.vision_checkpoint import expected_vision_shapes
    from refimpl.model.vision_config import MllamaConfig

    cfg = MllamaConfig.from_hf({
        "model_type": "mllama", "image_token_index": 50,
        "text_config": {"vocab_size": 50, "hidden_size": 24, "intermediate_size": 40, "num_hidden_layers": 2,
                        "num_attention_heads": 6, "num_key_value_heads": 2, "cross_attention_layers": [1]},
        "vision_config": {"hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 1,
                          "num_global_layers": 1, "attention_heads": 2, "image_size": 14, "patch_size": 7,
                          "max_num_tiles": 4, "vision_output_dim": 32, "intermediate_layers_indices": [0]},
    })
    rng = np.random.default_rng(0)
    params = {n: (0.1 * rng.standard_normal(s)).astype(np.float32) for n, s in expected_vision_shapes(cfg).items()}
    return cfg, params


def test_mllama_exact_ordered_lists():
    from refimpl.model.names import vision_activation_names

    cfg, _ = _mllama()
    assert vision_activation_names(cfg) == EXPECTED_MLLAMA["prompt with images"]
    assert vision_activation_names(cfg, encode_images=False, image_in_cache=True) == \
        EXPECTED_MLLAMA["decode after images"]
    assert vision_activation_names(cfg, encode_images=False) == EXPECTED_MLLAMA["no image"]


def test_mllama_forward_yields_exactly_the_scheme_with_documented_shapes():
    from refimpl.model.llama_vision import VisionCache, forward_steps
    from refimpl.vision.inputs import ImageInputs

    cfg, params = _mllama()
    pixels = np.random.default_rng(1).standard_normal((2, 4, 3, 14, 14)).astype(np.float32)
    images = ImageInputs.from_arrays(cfg.vision, pixels, [6, 1], [[1, 1, 1, 0], [1, 0, 0, 0]],
                                     np.ones((3, 2, 4), np.int64))
    cache = VisionCache.allocate(cfg.text, 8, lambda s: np.zeros(s, np.float32))
    seen = list(forward_steps(ops, params, cfg, np.array([50, 4, 50]), np.arange(3), cache, images))
    assert [n for n, _ in seen] == EXPECTED_MLLAMA["prompt with images"]
    shapes = dict((n, v.shape) for n, v in seen)
    I, A, P, Q, U, O, T, N, D, K, E = 2, 4, 5, 8, 16, 32, 3, 2 * 4 * 5, 24, 2, 4
    assert shapes["vision.patch_embed"] == (I, A, P - 1, U) and shapes["vision.pos_embed"] == (I, A, P, U)
    assert shapes["vision.layers.0.attn.q"] == (I, A * Q, 2, U // 2) and shapes["vision.post_tile"] == (I * A * Q, U)
    assert shapes["vision.out"] == (I, A, P, O) and shapes["projector"] == (N, D)
    assert shapes["layers.1.xattn.q_norm"] == (T, 6, E) and shapes["layers.1.xattn.k_norm"] == (N, K, E)
    decode = [n for n, _ in forward_steps(ops, params, cfg, np.array([7]), np.array([3]), cache)]
    assert decode == EXPECTED_MLLAMA["decode after images"]
    fresh = VisionCache.allocate(cfg.text, 8, lambda s: np.zeros(s, np.float32))
    assert [n for n, _ in forward_steps(ops, params, cfg, np.array([7]), np.array([0]), fresh)] == \
        EXPECTED_MLLAMA["no image"]
