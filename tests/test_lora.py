"""PEFT LoRA adapters: refimpl's load + fp32 merge against PEFT's own model (the oracle), and every refusal.

Oracle: a tiny random HF LlamaForCausalLM wrapped by peft.get_peft_model; PEFT initialises lora_B to zero (the
adapter would be a no-op), so B is randomised before saving. fp32 on both sides; 1e-4 absolute on logits, the same
budget as tests/test_refimpl_hf.py (summation order only). Each case also checks the adapter moves the logits by far
more than that budget, so a merge that did nothing could not pass.
"""
import json

import numpy as np
import pytest

from _badinput import assert_clean_error, generate_args, make_model, run_cli, tiny_config, write_tokenizer
from refimpl.model import ops
from refimpl.formats.checkpoint import load_checkpoint
from refimpl.formats.params import random_params
from refimpl.formats.lora import load_lora, merge_lora
from refimpl.model.llama import KVCache, forward
from refimpl.formats.safetensors_io import save_safetensors

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]
LORA_CASES = {
    # name: (LoraConfig kwargs, tie_word_embeddings)
    "plain": (dict(r=4, lora_alpha=8, target_modules=TARGETS), True),
    "patterns": (dict(r=4, lora_alpha=8, target_modules=TARGETS + ["up_proj"],
                      rank_pattern={"down_proj": 2, "model.layers.1.self_attn.q_proj": 6},
                      alpha_pattern={"o_proj": 3, r"layers\.0\.mlp\.up_proj": 16}), True),
    "rslora": (dict(r=4, lora_alpha=8, target_modules=TARGETS, use_rslora=True, rank_pattern={"v_proj": 8}), True),
    "lm_head untied": (dict(r=4, lora_alpha=4, target_modules=["q_proj", "lm_head"]), False),
}


def hf_base(path, tied, seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rope_theta=10000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=tied, initializer_range=0.1, bos_token_id=61, eos_token_id=62, attn_implementation="eager")
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(path)
    write_tokenizer(path)
    return model


def peft_adapter(base, path, lora_kwargs, seed=1):
    model = peft.get_peft_model(base, peft.LoraConfig(lora_dropout=0.0, **lora_kwargs)).eval()
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.2)  # PEFT starts B at zero: without this the adapter changes nothing
    model.save_pretrained(path)
    return model


def refimpl_logits(params, cfg, ids):
    cache = KVCache.allocate(cfg, len(ids), lambda shape: np.zeros(shape, np.float32))
    return forward(ops, params, cfg, np.asarray(ids), np.arange(len(ids)), cache)  # [T, V]


@pytest.mark.parametrize("case", list(LORA_CASES))
def test_merged_logits_match_peft(tmp_path, case):
    lora_kwargs, tied = LORA_CASES[case]
    base = hf_base(tmp_path / "base", tied)
    model = peft_adapter(base, tmp_path / "adapter", lora_kwargs)
    ids = [61, 5, 17, 33, 2, 40, 9]
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].numpy()

    ckpt = load_checkpoint(tmp_path / "base", with_tokenizer=False)
    adapter = load_lora(tmp_path / "adapter", ckpt.config)
    merged = merge_lora(ckpt.params, ckpt.config, adapter)
    got = refimpl_logits(merged, ckpt.config, ids)
    base_logits = refimpl_logits(ckpt.params, ckpt.config, ids)

    assert np.abs(got - want).max() < 1e-4
    assert np.abs(base_logits - want).max() > 1e-2  # the adapter matters at this tolerance
    n_modules = sum(1 for n, _ in model.named_modules() if n.endswith("lora_A"))
    assert len(adapter) == n_modules


def test_pattern_scales_are_peft_s(tmp_path):
    """Per-module rank and scale, read back from the adapter, equal what PEFT put on each module."""
    lora_kwargs, tied = LORA_CASES["patterns"]
    model = peft_adapter(hf_base(tmp_path / "base", tied), tmp_path / "adapter", lora_kwargs)
    ckpt = load_checkpoint(tmp_path / "base", with_tokenizer=False)
    ours = {name: (a.shape[0], scale) for name, a, _, scale in load_lora(tmp_path / "adapter", ckpt.config)}
    theirs = {}
    for name, module in model.named_modules():
        if hasattr(module, "scaling") and isinstance(module.scaling, dict) and "default" in module.scaling:
            key = name.removeprefix("base_model.model.") + ".weight"
            theirs[key] = (module.r["default"], module.scaling["default"])
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert ours[key][0] == theirs[key][0] and ours[key][1] == pytest.approx(theirs[key][1], rel=1e-12), key
    assert len({s for _, s in ours.values()}) >= 3  # the patterns really gave different scales


def test_cli_lora_generates_peft_greedy_tokens(tmp_path):
    lora_kwargs, tied = LORA_CASES["patterns"]
    model = peft_adapter(hf_base(tmp_path / "base", tied), tmp_path / "adapter", lora_kwargs)
    result = run_cli(generate_args(tmp_path / "base", "--lora", tmp_path / "adapter", "--json",
                                   "--max-new-tokens", "6", prompt="w1 w2 w3"))
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    ids = list(record["prompt_ids"])
    with torch.no_grad():
        for _ in range(len(record["generated_ids"])):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    assert record["generated_ids"] == ids[len(record["prompt_ids"]):]


# ---- refusals, on hand-written adapters against the tiny refimpl model ----
D, F = 16, 32  # tiny_config's hidden and intermediate sizes


def write_adapter(path, config=None, tensors=None, r=4):
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    cfg = {"peft_type": "LORA", "r": r, "lora_alpha": 8, "bias": "none", "target_modules": ["q_proj"]}
    cfg.update(config or {})
    if "__delete__" in cfg:
        for key in cfg.pop("__delete__"):
            cfg.pop(key)
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    if tensors is None:
        p = "base_model.model.model.layers.0.self_attn.q_proj."
        tensors = {p + "lora_A.weight": rng.standard_normal((r, D)), p + "lora_B.weight": rng.standard_normal((D, r))}
    save_safetensors(path / "adapter_model.safetensors", tensors)
    return path


Q = "base_model.model.model.layers.0.self_attn.q_proj."


REFUSALS = {
    "peft type": (dict(config={"peft_type": "PREFIX_TUNING"}), "peft_type 'PREFIX_TUNING' is not supported"),
    "dora": (dict(config={"use_dora": True}), "DoRA adapters (use_dora) are not supported"),
    "bias": (dict(config={"bias": "all"}), "bias='all' is not supported"),
    "fan_in_fan_out": (dict(config={"fan_in_fan_out": True}), "fan_in_fan_out adapters"),
    "lora_bias": (dict(config={"lora_bias": True}), "lora_bias adapters are not supported"),
    "modules_to_save": (dict(config={"modules_to_save": ["lm_head"]}), "modules_to_save is not supported"),
    "embedding module": (dict(tensors={"base_model.model.model.embed_tokens.lora_A.weight": np.ones((4, 64)),
                                       "base_model.model.model.embed_tokens.lora_B.weight": np.ones((16, 4))}),
                         "adapts module 'model.embed_tokens'; only the Llama linears"),
    "lm_head on a tied model": (dict(tensors={"base_model.model.lm_head.lora_A.weight": np.ones((4, D)),
                                              "base_model.model.lm_head.lora_B.weight": np.ones((64, 4))}),
                                "adapts module 'lm_head'"),
    "another base (width)": (dict(tensors={Q + "lora_A.weight": np.ones((4, 32)),
                                           Q + "lora_B.weight": np.ones((32, 4))}),
                             "expected [4, 16] and [16, 4]"),
    "another base (depth)": (dict(tensors={
        "base_model.model.model.layers.7.mlp.down_proj.lora_A.weight": np.ones((4, F)),
        "base_model.model.model.layers.7.mlp.down_proj.lora_B.weight": np.ones((D, 4))}),
        "'model.layers.7.mlp.down_proj.weight', which this base model does not have"),
    "rank disagrees with config": (dict(config={"r": 8}), "expected [8, 16] and [16, 8]"),
    "missing lora_B": (dict(tensors={Q + "lora_A.weight": np.ones((4, D))}), "has no lora_B matrix"),
    "not a LoRA tensor": (dict(tensors={"base_model.model.model.layers.0.self_attn.q_proj.weight": np.ones((D, D))}),
                          "is not a LoRA matrix"),
    "empty adapter": (dict(tensors={}), "holds no LoRA matrices"),
    "r not a number": (dict(config={"r": "four"}), "r must be a positive integer"),
    "alpha negative": (dict(config={"lora_alpha": -1}), "lora_alpha must be a positive number"),
    "bad rank_pattern regex": (dict(config={"rank_pattern": {"q_proj(": 2}}), "is not a valid regular expression"),
    "rank_pattern not an object": (dict(config={"rank_pattern": [2]}), "rank_pattern and alpha_pattern must be"),
}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("lora") / "m", tiny_config(), random_params(tiny_config(), seed=0))


@pytest.mark.parametrize("case", list(REFUSALS))
def test_cli_refuses_adapter(tmp_path, tiny_model, case):
    kwargs, expected = REFUSALS[case]
    adapter = write_adapter(tmp_path / "adapter", **kwargs)
    assert_clean_error(run_cli(generate_args(tiny_model, "--lora", adapter)), "adapter", expected)


def test_handwritten_adapter_merges(tmp_path, tiny_model):
    """The hand-written adapter used above is valid as written: the merge is W + (alpha/r) B A."""
    adapter = write_adapter(tmp_path / "adapter")
    ckpt = load_checkpoint(tiny_model, with_tokenizer=False)
    (name, a, b, scale), = load_lora(adapter, ckpt.config)
    merged = merge_lora(ckpt.params, ckpt.config, [(name, a, b, scale)])
    want = ckpt.params[name].astype(np.float64) + 2.0 * b.astype(np.float64) @ a.astype(np.float64)
    assert scale == 2.0 and np.abs(merged[name] - want).max() < 1e-5
    assert all(merged[k] is ckpt.params[k] for k in ckpt.params if k != name)
    assert run_cli(generate_args(tiny_model, "--lora", adapter)).exit_code == 0


def test_adapter_directory_problems(tmp_path, tiny_model):
    assert_clean_error(run_cli(generate_args(tiny_model, "--lora", tmp_path / "nope")), "nope",
                       "expects a PEFT adapter directory")
    (tmp_path / "empty").mkdir()
    assert_clean_error(run_cli(generate_args(tiny_model, "--lora", tmp_path / "empty")),
                       "adapter_config.json: not found")
    adapter = write_adapter(tmp_path / "a")
    (adapter / "adapter_config.json").write_text("{oops")
    assert_clean_error(run_cli(generate_args(tiny_model, "--lora", adapter)), "adapter_config.json",
                       "not valid JSON")
    adapter = write_adapter(tmp_path / "b")
    (adapter / "adapter_model.safetensors").unlink()
    (adapter / "adapter_model.bin").write_bytes(b"\x80\x04 pickle")
    assert_clean_error(run_cli(generate_args(tiny_model, "--lora", adapter)), "adapter_model.safetensors",
                       "never loads")
