"""The residual-stream rotation (refimpl.quant.rotate) against independent checks: orthogonality measured directly
(RᵀR = I), and the rotated model's logits against the original model's, computed by Hugging Face transformers (a tiny
random Llama whose sizes are not powers of two, every norm weight random) and by the refimpl on the toy checkpoint."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from refimpl.compare import TOLERANCES, compare
from refimpl.formats.checkpoint import load_checkpoint
from refimpl.model import ops
from refimpl.model.config import LlamaConfig
from refimpl.model.llama import KVCache, forward
from refimpl.quant import rotate

TOY = Path(__file__).resolve().parent.parent / "golden" / "toy-gqa"  # D = 64, E = 16: Hadamard only


@pytest.mark.parametrize("d", [1, 2, 8, 12, 48, 64, 576])
def test_rotations_are_orthogonal(d):
    r = rotate.rotation(d, seed=3)
    assert r.shape == (d, d)
    np.testing.assert_allclose(r.T @ r, np.eye(d), rtol=0, atol=1e-12)
    np.testing.assert_allclose(r @ r.T, np.eye(d), rtol=0, atol=1e-12)
    if d >= 8:  # incoherent: no entry carries more than a few times its share 1/√d
        assert np.abs(r).max() < 4 / np.sqrt(d)
        assert not np.allclose(r, rotate.rotation(d, seed=4))


def test_hadamard_entries():
    h = rotate.hadamard(16)
    np.testing.assert_array_equal(np.abs(h) * 4, np.ones((16, 16)))
    np.testing.assert_allclose(h @ h.T, np.eye(16), rtol=0, atol=1e-15)
    with pytest.raises(ValueError, match="power of two"):
        rotate.hadamard(12)


def test_rotation_spreads_a_large_column():
    """A weight matrix with one column 30× the others: after W·R no column stands out, so a per-row scale (max |w|
    of the row) is no longer set by one column. The rows' norms are kept."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((32, 48))
    w[:, 7] *= 30
    wr = w @ rotate.rotation(48)
    peak = lambda m: (np.abs(m).max(1) / np.sqrt((m * m).mean(1))).mean()  # noqa: E731
    assert peak(w) > 5.5 and peak(wr) < 2.5  # a Gaussian row of 48: about 2.4
    np.testing.assert_allclose(np.linalg.norm(wr, axis=1), np.linalg.norm(w, axis=1), rtol=1e-12)


def _hf_model(cfg_dict: dict, state: dict | None = None):
    torch, transformers = pytest.importorskip("torch"), pytest.importorskip("transformers")
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg_dict, attn_implementation="eager")).eval()
    with torch.no_grad():
        if state is None:  # every parameter random, the norm weights around 1 but all different
            torch.manual_seed(0)
            for name, p in model.named_parameters():
                p.copy_(1 + 0.5 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
        else:
            model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=True)
    return model


@pytest.mark.parametrize("tied", [True, False])
def test_rotated_model_is_an_ordinary_llama_to_transformers(tied):
    """hidden 48 = 3·16 and head_dim 12 = 3·4 (the Kronecker construction), grouped-query attention, a tied head or
    an untied one of its own random values: the rotated weights, loaded into an untied transformers Llama with unit
    norm weights, give the original logits."""
    import torch
    base = dict(vocab_size=61, hidden_size=48, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=12, rms_norm_eps=1e-5, rope_theta=10000.0,
                max_position_embeddings=64, tie_word_embeddings=tied)
    model = _hf_model(base)
    params = {k: v.numpy().copy() for k, v in model.state_dict().items() if k != "lm_head.weight" or not tied}
    if not tied:  # the head under test is the source's own, not the embedding
        assert not np.allclose(params["lm_head.weight"], params["model.embed_tokens.weight"], atol=1e-2)
    ids = torch.tensor([[3, 17, 5, 40, 9, 60, 0, 22, 31, 8, 8, 44]])
    with torch.no_grad():
        want = model(ids).logits[0].numpy()
    rotated, cfg = rotate.rotate_model(params, LlamaConfig.from_hf(base), seed=1)
    assert cfg.tie_word_embeddings is False
    assert all(np.array_equal(v, np.ones_like(v)) for k, v in rotated.items() if k.endswith("norm.weight"))
    for key in ("model.embed_tokens.weight", "model.layers.1.self_attn.v_proj.weight",
                "model.layers.1.self_attn.o_proj.weight", "model.layers.0.mlp.down_proj.weight"):
        assert not np.allclose(rotated[key], params[key], atol=1e-2), key
    with torch.no_grad():
        got = _hf_model({**base, "tie_word_embeddings": False}, rotated)(ids).logits[0].numpy()
    c = compare("logits", got, want, TOLERANCES["fp32"])
    assert c.ok, c


def test_value_rotation_turns_each_head_block_by_rv():
    """values=True against values=False on the toy (H = 4 query heads, K = 2 kv heads, E = 16): each kv head's
    v_proj row block is rvᵀ·block, each query head's o_proj column block is block·rv, rv = rotation(E, seed + 1)
    built here; every other tensor is the same."""
    src = load_checkpoint(TOY)
    cfg = src.config
    H, K, E, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
    assert H != K and np.diff([H, K, E]).all()  # the blocks cannot be cut along the wrong axis unnoticed
    plain, _ = rotate.rotate_model(src.params, cfg, seed=5, values=False)
    turned, _ = rotate.rotate_model(src.params, cfg, seed=5, values=True)
    rv = rotate.rotation(E, seed=6).astype(np.float64)
    assert not np.allclose(rv, np.eye(E), atol=0.1)
    for i in range(cfg.num_hidden_layers):
        v, o = f"model.layers.{i}.self_attn.v_proj.weight", f"model.layers.{i}.self_attn.o_proj.weight"
        for k in range(K):
            rows = slice(k * E, (k + 1) * E)
            np.testing.assert_allclose(turned[v][rows], rv.T @ plain[v][rows], rtol=1e-5, atol=1e-6)
        for h in range(H):
            cols = slice(h * E, (h + 1) * E)
            np.testing.assert_allclose(turned[o][:, cols], plain[o][:, cols] @ rv, rtol=1e-5, atol=1e-6)
        assert turned[v].shape == (K * E, D) and turned[o].shape == (D, H * E)
    same = [k for k in plain if not k.endswith(("v_proj.weight", "o_proj.weight"))]
    assert same and all(np.array_equal(turned[k], plain[k]) for k in same)


@pytest.mark.parametrize("values", [False, True])
def test_rotated_toy_checkpoint_keeps_its_logits(values):
    """The toy checkpoint (D = 64: a randomized Hadamard) through the refimpl's forward, with and without the value
    rotation: the logits of the original weights."""
    src = load_checkpoint(TOY)
    ids = np.random.default_rng(0).integers(0, src.config.vocab_size, 40)

    def logits(params, cfg):
        cache = KVCache.allocate(cfg, len(ids), lambda s: np.zeros(s, np.float32))
        return forward(ops, params, cfg, ids, np.arange(len(ids)), cache)

    rotated, cfg = rotate.rotate_model(src.params, src.config, seed=0, values=values)
    assert rotated["lm_head.weight"].shape == src.params["model.embed_tokens.weight"].shape
    c = compare("logits", logits(rotated, cfg), logits(src.params, src.config), TOLERANCES["fp32"])
    assert c.ok, c


def test_rotating_quantized_or_biased_params_is_refused():
    from refimpl.errors import QuantError
    from refimpl.quant.schemes import QuantSpec
    src = load_checkpoint(TOY)
    key = "model.layers.0.mlp.up_proj.weight"
    params = src.params | {key: QuantSpec.parse("int8").quantize(src.params[key])}
    with pytest.raises(QuantError, match=f"{key} is a QuantizedLinear"):
        rotate.rotate_model(params, src.config)
    bias = src.params | {"model.layers.0.self_attn.o_proj.bias": np.zeros(64, np.float32)}
    with pytest.raises(QuantError, match="o_proj.bias is not a tensor of a bias-free Llama"):
        rotate.rotate_model(bias, src.config)


def test_quantize_rotate_writes_an_ordinary_checkpoint_both_engines_run(tmp_path):
    """`llama32 quantize --rotate` on the toy: the config records the rotation and unties the head, the norms are 1,
    the int8 model's logits stay near the original (unrotated, unquantized) model's, and both engines load it and
    pick the same greedy tokens."""
    torch = pytest.importorskip("torch")
    from _badinput import run_cli
    from accel.engine import AccelEngine
    from refimpl.generate import RefEngine, Sampling
    (tmp_path / "calib.txt").write_text("Call me Ishmael. Some years ago, having little or no money in my purse, and "
                                        "nothing particular to interest me on shore, I thought I would sail. " * 6)
    out = tmp_path / "rot-int8"
    r = run_cli(["quantize", "--model", TOY, "--quant", "int8", "--method", "gptq", "--rotate", "--calib",
                 tmp_path / "calib.txt", "--out", out])
    assert r.exit_code == 0, r.output
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    assert config["quantization_config"]["rotation"] == {"residual": True, "values": True, "seed": 0,
                                                          "construction": "hadamard-kron-haar"}
    back, src = load_checkpoint(out), load_checkpoint(TOY)
    assert all(np.array_equal(v, np.ones_like(v)) for k, v in back.params.items() if k.endswith("norm.weight"))
    ids = src.tokenizer.encode("It was the best of times, it was the worst of times.")
    cache = lambda cfg: KVCache.allocate(cfg, len(ids), lambda s: np.zeros(s, np.float32))  # noqa: E731
    got = forward(ops, back.params, back.config, np.asarray(ids), np.arange(len(ids)), cache(back.config))
    want = forward(ops, src.params, src.config, np.asarray(ids), np.arange(len(ids)), cache(src.config))
    c = compare("logits", got, want, TOLERANCES["bf16"])
    assert c.ok, c
    acc = AccelEngine.from_checkpoint(back, device="cpu", dtype="fp32", use_triton=False)
    assert acc.weights.lm_head is not acc.weights.embed
    prompt, s = back.tokenizer.encode("the sea"), Sampling(max_new_tokens=4)
    with torch.no_grad():
        assert list(acc.generate(prompt, s)) == list(RefEngine(back).generate(prompt, s))
