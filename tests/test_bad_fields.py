"""Every config field HF's LlamaConfig defines has an explicit decision (refimpl/model/config_fields.py), and each
decision is tested: refused values name the field and what is supported; ignored fields are shown not to change
HF's own logits (the oracle), so ignoring them cannot make llama32 differ from HF.
"""
import dataclasses
import json
import math
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _badinput import assert_clean_error, edit_config, generate_args, make_model, run_cli
from refimpl.errors import ConfigError, MAX_LINE_CHARS
from refimpl.model.config import LlamaConfig
from refimpl.model.config_fields import IGNORED, IMPLEMENTED, LLAMA_FIELDS, REFUSED, ROPE_FIELDS

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

BASE = dict(model_type="llama", vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0,
            tie_word_embeddings=True, max_position_embeddings=64)
LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=16)


def hf_field_names() -> set[str]:
    """The fields the installed transformers gives LlamaConfig and PretrainedConfig (dataclass fields in v5)."""
    cls = transformers.LlamaConfig
    names = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    if not names:  # transformers 4: the __init__ signature and the attributes PretrainedConfig sets
        import inspect
        names = set(inspect.signature(cls.__init__).parameters) - {"self", "kwargs"}
        names |= set(vars(transformers.PretrainedConfig()))
    return {n for n in names if not n.startswith("_")}


def test_table_covers_every_hf_field():
    missing = sorted(hf_field_names() - set(LLAMA_FIELDS))
    assert not missing, f"decide these fields in refimpl/model/config_fields.py: {missing}"
    assert all(rule.why for rule in LLAMA_FIELDS.values())


# one bad value for every refused field (and the messages name the field)
BAD_VALUES = {
    "architectures": ["LlamaForSequenceClassification"], "is_encoder_decoder": True, "add_cross_attention": True,
    "quantization_config": {"quant_method": "gptq", "bits": 4}, "model_type": "llama",  # model_type: own check
    "tie_word_embeddings": "false", "hidden_act": "gelu", "attention_bias": True, "mlp_bias": True,
}


@pytest.mark.parametrize("name", sorted(n for n, r in LLAMA_FIELDS.items() if r.decision == REFUSED))
def test_refused_field(name):
    if name == "model_type":
        with pytest.raises(ConfigError, match="model_type 'mistral' is not supported"):
            LlamaConfig.from_hf({**BASE, "model_type": "mistral"})
        return
    with pytest.raises(ConfigError, match=f"{name} = .* is not supported; expected"):
        LlamaConfig.from_hf({**BASE, name: BAD_VALUES[name]})
    if name not in ("tie_word_embeddings",):  # the value HF computes as llama32 does is accepted
        good = {"architectures": ["LlamaForCausalLM"], "hidden_act": "silu"}.get(name, None)
        LlamaConfig.from_hf({**BASE, name: good})


@pytest.mark.parametrize("name, value", [
    ("rope_type", "linear"), ("rope_type", "dynamic"), ("rope_type", "yarn"), ("rope_type", "longrope"),
    ("factor", float("nan")), ("factor", float("inf")), ("factor", 0), ("factor", -2.0), ("factor", "8"),
    ("low_freq_factor", float("inf")), ("high_freq_factor", float("nan")), ("partial_rotary_factor", 0.5),
    ("beta_fast", 32), ("short_factor", [1.0]),
])
def test_refused_rope_field(name, value):
    with pytest.raises(ConfigError, match=f"rope_scaling.{name}"):
        LlamaConfig.from_hf({**BASE, "rope_scaling": {**LLAMA3, name: value}})


def test_rope_table_refuses_every_non_llama3_type():
    for rope_type in ("linear", "dynamic", "yarn", "longrope", "proportional", "mrope"):
        for key in ("rope_type", "type"):
            with pytest.raises(ConfigError, match="not implemented"):
                LlamaConfig.from_hf({**BASE, "rope_parameters": {key: rope_type, "factor": 2.0, "rope_theta": 1e4}})
    assert {"rope_type", "type", "factor", "partial_rotary_factor"} <= set(ROPE_FIELDS)


def hf_logits(cfg_dict, ids=(3, 17, 5, 40, 9)):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg_dict)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
        return model(torch.tensor([list(ids)])).logits[0].numpy()


IGNORED_VALUES = {  # fields whose decision says "cannot change the result": HF's logits agree
    "pretraining_tp": 2, "attention_dropout": 0.5, "initializer_range": 0.9, "use_cache": False,
    "pad_token_id": 3, "chunk_size_feed_forward": 2, "output_attentions": True, "output_hidden_states": True,
    "dtype": "float32", "torch_dtype": "bfloat16", "num_labels": 7, "temperature": 0.1,
}


@pytest.mark.parametrize("name", sorted(IGNORED_VALUES))
def test_ignored_field_does_not_change_hf(name):
    assert LLAMA_FIELDS[name].decision == IGNORED
    want = hf_logits({**BASE, "attn_implementation": "eager"})
    got = hf_logits({**BASE, "attn_implementation": "eager", name: IGNORED_VALUES[name]})
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    assert LlamaConfig.from_hf({**BASE, name: IGNORED_VALUES[name]}) == LlamaConfig.from_hf(BASE)  # llama32 ignores it


def test_every_ignored_field_is_accepted():
    base = LlamaConfig.from_hf(BASE)
    ignored = [name for name, rule in LLAMA_FIELDS.items() if rule.decision == IGNORED]
    assert ignored
    for name in ignored:  # accepted, and without effect on the config llama32 builds
        assert LlamaConfig.from_hf({**BASE, name: {"anything": [1, "x"]}}) == base, name


def test_implemented_fields_are_read():
    """Changing an implemented field changes the config llama32 builds (it is not silently dropped)."""
    base = LlamaConfig.from_hf(BASE)
    changes = {"vocab_size": 65, "hidden_size": 32, "intermediate_size": 33, "num_hidden_layers": 3,
               "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 8, "rms_norm_eps": 1e-6,
               "rope_theta": 5e5, "rope_scaling": LLAMA3, "rope_parameters": {"rope_type": "default",
                                                                               "rope_theta": 7.0},
               "bos_token_id": 1, "eos_token_id": [2, 3], "max_position_embeddings": 128}
    assert set(changes) == {n for n, r in LLAMA_FIELDS.items() if r.decision == IMPLEMENTED}
    for name, value in changes.items():
        assert LlamaConfig.from_hf({**BASE, name: value}) != base or name == "eos_token_id", name
    assert LlamaConfig.from_hf({**BASE, "eos_token_id": [2, 3]}).eos_token_ids == (2, 3)


# ---- through the CLI: the examples of the issue, with the tensors a real file would carry ----
@pytest.mark.parametrize("field, value, extra", [
    ("attention_bias", True, "self_attn.q_proj.bias"), ("mlp_bias", True, "mlp.up_proj.bias"),
    ("hidden_act", "gelu_pytorch_tanh", None), ("tie_word_embeddings", "false", None),
    ("pretraining_tp", 2, None),
])
def test_cli(tmp_path, field, value, extra):
    from refimpl.formats.params import random_params
    from _badinput import tiny_config
    params = random_params(tiny_config())
    if extra:
        for i in range(2):
            params[f"model.layers.{i}.{extra}"] = np.ones(16 if "self_attn" in extra else 32, np.float32)
    model = make_model(tmp_path / "m", params=params)
    edit_config(model, **{field: value})
    result = run_cli(generate_args(model))
    if field == "pretraining_tp":  # ignored: runs
        assert result.exit_code == 0, result.output
    else:
        assert_clean_error(result, "config.json", field)


# ---- fuzz: any JSON value in any known field -> a config or one short ConfigError, quickly ----
JSON = st.recursive(st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) |
                    st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=300),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner,
                                                                                max_size=4), max_leaves=10)


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(sorted(LLAMA_FIELDS) + ["rope_scaling"]), JSON, max_size=4),
       st.dictionaries(st.sampled_from(sorted(ROPE_FIELDS)), JSON, max_size=3))
def test_fuzz_config_fields(changes, rope):
    d = {**BASE, **changes}
    if rope:
        d["rope_scaling"] = {**LLAMA3, **rope}
    t0 = time.perf_counter()
    try:
        cfg = LlamaConfig.from_hf(d)
    except ConfigError as e:
        assert len("error: " + str(e)) <= MAX_LINE_CHARS and "\n" not in str(e)
    else:  # accepted: every value llama32 computes with is sane
        assert cfg.tie_word_embeddings in (True, False)
        assert all(math.isfinite(x) for x in (cfg.rms_norm_eps, cfg.rope_theta))
        if cfg.rope_scaling is not None:
            assert all(math.isfinite(x) and x > 0 for x in dataclasses.astuple(cfg.rope_scaling))
        assert d.get("hidden_act", "silu") == "silu" and d.get("attention_bias", False) is False
        json.dumps(cfg.to_hf())
    assert time.perf_counter() - t0 < 1.0


# ---- Llama 3.2 Vision: the same table mechanism over MllamaConfig and its two sub-configs ----
def mllama_field_names():
    from transformers.models.mllama import configuration_mllama as m
    common = {f.name for f in dataclasses.fields(transformers.PretrainedConfig)}
    return {cls: {f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")} | common
            for cls in (m.MllamaConfig, m.MllamaTextConfig, m.MllamaVisionConfig)}


def test_mllama_tables_cover_every_hf_field():
    from refimpl.model.config_fields import MLLAMA_FIELDS, MLLAMA_TEXT_FIELDS, MLLAMA_VISION_FIELDS
    tables = dict(zip(mllama_field_names(), (MLLAMA_FIELDS, MLLAMA_TEXT_FIELDS, MLLAMA_VISION_FIELDS)))
    for cls, table in tables.items():
        missing = sorted(n for n in mllama_field_names()[cls] if n not in table)
        assert not missing, f"{cls.__name__}: decide {missing} in refimpl/model/config_fields.py"


@pytest.mark.parametrize("section, name, value", [
    ("text_config", "hidden_act", "gelu"), ("text_config", "mlp_bias", True), ("text_config", "attention_bias", True),
    ("text_config", "tie_word_embeddings", "no"), ("text_config", "rope_scaling", {"rope_type": "yarn"}),
    ("vision_config", "hidden_act", "quick_gelu"), ("vision_config", "model_type", "clip_vision_model"),
    (None, "architectures", ["LlavaForConditionalGeneration"]), (None, "quantization_config", {"bits": 4}),
])
def test_mllama_refused_fields(section, name, value):
    from test_vision_checkpoint import tiny_config as mllama_tiny
    from refimpl.model.vision_config import MllamaConfig
    d = mllama_tiny()
    MllamaConfig.from_hf(d)  # the unedited config is fine
    (d[section] if section else d)[name] = value
    with pytest.raises(ConfigError, match=name):
        MllamaConfig.from_hf(d)
