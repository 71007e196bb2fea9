"""The NumPy reference against HF transformers' LlamaForCausalLM (the independent oracle), tiny random configs.

fp32 tolerance 1e-4 absolute on logits: both sides compute in fp32; they differ only in summation order (BLAS vs
torch kernels), which moves logits of this size by ~1e-6. llama3 rope scaling is exercised at positions up to ~6×
original_max_position_embeddings, where leaving the scaling out would change logits by O(1).
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from refimpl.model import ops  # noqa: E402
from refimpl.formats.checkpoint import load_checkpoint  # noqa: E402
from refimpl.generate import RefEngine, Sampling  # noqa: E402
from refimpl.model.llama import KVCache, forward  # noqa: E402

ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}

CONFIGS = {
    # name: (heads, kv_heads, head_dim or None, tied)
    "mha": (4, 4, None, True),
    "gqa2": (4, 2, None, False),
    "gqa4": (8, 2, None, True),
    "mqa": (4, 1, None, False),
    "head_dim_24": (4, 2, 24, True),  # explicit head_dim != hidden / heads (64 / 4 = 16)
}


def hf_model(tmp_path, heads, kv_heads, head_dim, tied, rope=ROPE, seed=0):
    torch.manual_seed(seed)
    kw = {"head_dim": head_dim} if head_dim else {}
    cfg = transformers.LlamaConfig(
        vocab_size=211, hidden_size=64, intermediate_size=112, num_hidden_layers=3, num_attention_heads=heads,
        num_key_value_heads=kv_heads, max_position_embeddings=4096, rope_theta=500000.0, rope_scaling=rope,
        tie_word_embeddings=tied, rms_norm_eps=1e-5, initializer_range=0.1, bos_token_id=1, eos_token_id=2,
        attn_implementation="eager", **kw)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # norm weights start at exactly 1; move them so a wrong weight use would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(tmp_path)
    return model


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids)[None]).logits[0].numpy()


@pytest.fixture(params=list(CONFIGS))
def pair(request, tmp_path):
    model = hf_model(tmp_path, *CONFIGS[request.param])
    return model, load_checkpoint(tmp_path, with_tokenizer=False)


def fresh_cache(ckpt, capacity):
    return KVCache.allocate(ckpt.config, capacity, lambda shape: np.zeros(shape, np.float32))


def test_config_read_from_hf(pair):
    model, ckpt = pair
    hc, c = model.config, ckpt.config
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (
        hc.num_attention_heads, hc.num_key_value_heads, hc.head_dim)
    assert c.tie_word_embeddings == hc.tie_word_embeddings
    assert c.rope_scaling is not None and c.rope_scaling.original_max_position_embeddings == 32


def test_logits_match_hf_past_original_context(pair):
    model, ckpt = pair
    ids = np.random.default_rng(1).integers(0, 211, 200)  # positions 0..199, original context 32
    ours = forward(ops, ckpt.params, ckpt.config, ids, np.arange(len(ids)), fresh_cache(ckpt, 200))
    ref = hf_logits(model, ids.tolist())
    assert np.abs(ours - ref).max() < 1e-4
    # the scaling matters at these positions: the same weights without it disagree grossly
    unscaled = ckpt.config.__class__(**{**ckpt.config.__dict__, "rope_scaling": None})
    wrong = forward(ops, ckpt.params, unscaled, ids, np.arange(len(ids)), fresh_cache(ckpt, 200))
    assert np.abs(wrong[150:] - ref[150:]).max() > 1e-2


def test_cached_steps_equal_full_forward(pair):
    _, ckpt = pair
    ids = np.random.default_rng(2).integers(0, 211, 60)
    full = forward(ops, ckpt.params, ckpt.config, ids, np.arange(60), fresh_cache(ckpt, 60))
    cache = fresh_cache(ckpt, 60)
    steps = [forward(ops, ckpt.params, ckpt.config, ids[:45], np.arange(45), cache)]  # prefill
    for p in range(45, 60):  # then one token at a time
        steps.append(forward(ops, ckpt.params, ckpt.config, ids[p:p + 1], np.array([p]), cache))
    assert np.abs(np.concatenate(steps) - full).max() < 1e-5


def test_greedy_20_tokens_identical_to_hf_generate(pair):
    model, ckpt = pair
    prompt = [1, 17, 33, 90, 5, 150, 64]
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    expected = out[0, len(prompt):].tolist()
    got = list(RefEngine(ckpt).generate(prompt, Sampling(max_new_tokens=20)))
    assert got == expected


def test_default_rope_without_scaling(tmp_path):
    model = hf_model(tmp_path, 4, 2, None, True, rope=None)
    ckpt = load_checkpoint(tmp_path, with_tokenizer=False)
    assert ckpt.config.rope_scaling is None
    ids = np.random.default_rng(3).integers(0, 211, 40)
    ours = forward(ops, ckpt.params, ckpt.config, ids, np.arange(40), fresh_cache(ckpt, 40))
    assert np.abs(ours - hf_logits(model, ids.tolist())).max() < 1e-4
