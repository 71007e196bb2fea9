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
