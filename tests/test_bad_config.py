"""config.json against the checkpoint, tokenizer files, and the mistakes a new user makes, all through the CLI."""
import json

import numpy as np
import pytest

from _badinput import (assert_clean_error, edit_config, generate_args, make_model, run_cli, tiny_config,
                       write_tokenizer)
from refimpl.formats.params import random_params


# ---- checkpoint vs config ----
def test_missing_tensor(tmp_path):
    params = random_params(tiny_config())
    del params["model.layers.1.self_attn.k_proj.weight"]
    model = make_model(tmp_path / "m", params=params)
    assert_clean_error(run_cli(generate_args(model)), "missing tensor 'model.layers.1.self_attn.k_proj.weight'")


def test_extra_unknown_tensor_only_warns(tmp_path):
    params = random_params(tiny_config())
    params["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(2, np.float32)
    model = make_model(tmp_path / "m", params=params)
    result = run_cli(generate_args(model))
    assert result.exit_code == 0, result.output
    assert "warning:" in result.stderr and "rotary_emb.inv_freq" in result.stderr


def test_shape_not_matching_config(tmp_path):
    model = make_model(tmp_path / "m")
    edit_config(model, intermediate_size=48)
    assert_clean_error(run_cli(generate_args(model)), "has shape [32, 16], but config.json implies [48, 16]")


def test_config_claims_more_layers(tmp_path):
    model = make_model(tmp_path / "m")
    edit_config(model, num_hidden_layers=3)
    assert_clean_error(run_cli(generate_args(model)), "missing tensor 'model.layers.2.", "3 layers")


def test_config_claiming_a_trillion_layers_fails_fast(tmp_path):
    """The expected-tensor list must not be built for 10^12 layers (it would hang and exhaust memory)."""
    model = make_model(tmp_path / "m")
    edit_config(model, num_hidden_layers=10 ** 12)
    assert_clean_error(run_cli(generate_args(model)), "missing tensor 'model.layers.2.input_layernorm.weight'",
                       "1000000000000 layers")


@pytest.mark.parametrize("changes, expected", [
    ({"head_dim": None, "num_attention_heads": 3}, "num_attention_heads (3) must divide hidden_size (16)"),
    ({"num_key_value_heads": 3}, "num_key_value_heads (3) must divide num_attention_heads (4)"),
    ({"num_attention_heads": 0, "head_dim": None}, "num_attention_heads must be a positive integer, got 0"),
    ({"num_key_value_heads": 0}, "num_key_value_heads must be a positive integer, got 0"),
    ({"hidden_size": None}, "missing required field 'hidden_size'"),
    ({"vocab_size": None}, "missing required field 'vocab_size'"),
    ({"hidden_size": "16"}, "field 'hidden_size' must be an integer, got '16'"),
    ({"intermediate_size": 32.5}, "field 'intermediate_size' must be an integer, got 32.5"),
    ({"rms_norm_eps": "tiny"}, "field 'rms_norm_eps' must be a number"),
    ({"rms_norm_eps": -1.0}, "rms_norm_eps must be a positive number"),
    ({"num_hidden_layers": True}, "field 'num_hidden_layers' must be an integer, got True"),
    ({"model_type": "mistral"}, "model_type 'mistral' is not supported (expected 'llama')"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type = 'yarn' is not supported"),
    ({"rope_scaling": "llama3"}, "rope_scaling must be an object or null"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling.low_freq_factor must be a number"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 32}}, "0 < low_freq_factor < high_freq_factor"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 32}}, "factor > 0"),
    ({"rope_theta": "big"}, "rope_theta must be a number"),
    ({"eos_token_id": "</s>"}, "eos_token_id must be an integer or a list of integers"),
])
def test_bad_config_field(tmp_path, changes, expected):
    model = make_model(tmp_path / "m")
    edit_config(model, **changes)
    assert_clean_error(run_cli(generate_args(model)), "config.json", expected)


@pytest.mark.parametrize("content, expected", [
    ("{\"vocab_size\": 64,", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    (b"\xff\xfe{}", "not valid JSON"),
])
def test_config_not_json(tmp_path, content, expected):
    model = make_model(tmp_path / "m")
    path = model / "config.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    assert_clean_error(run_cli(generate_args(model)), "config.json", expected)


# ---- a new user's mistakes ----
def test_wrong_path(tmp_path):
    assert_clean_error(run_cli(generate_args(tmp_path / "Llama-3.2-1B")), "Llama-3.2-1B", "no such file or directory")


def test_directory_without_config(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "model.safetensors").write_bytes(b"")
    assert_clean_error(run_cli(generate_args(tmp_path / "m")), "config.json", "not found")


def test_config_json_is_a_directory(tmp_path):
    model = make_model(tmp_path / "m")
    (model / "config.json").unlink()
    (model / "config.json").mkdir()
    assert_clean_error(run_cli(generate_args(model)), "config.json", "is a directory, expected a regular file")


def test_directory_without_weights(tmp_path):
    model = make_model(tmp_path / "m")
    (model / "model.safetensors").unlink()
    assert_clean_error(run_cli(generate_args(model)), "no model.safetensors")


def test_pointing_at_the_weights_file_instead_of_the_directory(tmp_path):
    model = make_model(tmp_path / "m")
    assert_clean_error(run_cli(generate_args(model / "model.safetensors")), "model.safetensors",
                       "expected a model directory")


def test_truncated_download(tmp_path):
    model = make_model(tmp_path / "m")
    raw = (model / "model.safetensors").read_bytes()
    (model / "model.safetensors").write_bytes(raw[: len(raw) // 2])
    assert_clean_error(run_cli(generate_args(model)), "model.safetensors", "truncated download?")


# ---- tokenizer files ----
def test_tokenizer_missing(tmp_path):
    model = make_model(tmp_path / "m", tokenizer=False)
    assert_clean_error(run_cli(generate_args(model)), "tokenizer.json", "not found")


@pytest.mark.parametrize("content", [b"{\"model\": ", b"[]", b"\x00\x01\x02", b"{\"version\": \"1.0\"}"])
def test_tokenizer_malformed(tmp_path, content):
    model = make_model(tmp_path / "m")
    (model / "tokenizer.json").write_bytes(content)
    assert_clean_error(run_cli(generate_args(model)), "tokenizer.json", "not a valid tokenizers file")


@pytest.mark.parametrize("content, expected", [
    (b"{\"chat_template\": ", "not valid JSON"),
    (b"[\"x\"]", "expected a JSON object"),
    (json.dumps({"chat_template": 7}).encode(), "chat_template must be a string"),
    (json.dumps({"bos_token": 5}).encode(), "bos_token must be a string"),
])
def test_tokenizer_config_malformed(tmp_path, content, expected):
    model = make_model(tmp_path / "m")
    (model / "tokenizer_config.json").write_bytes(content)
    assert_clean_error(run_cli(generate_args(model)), "tokenizer_config.json", expected)


def test_chat_template_file_not_utf8(tmp_path):
    model = make_model(tmp_path / "m")
    (model / "chat_template.jinja").write_bytes(b"\xff\xfe{{ messages }}")
    assert_clean_error(run_cli(generate_args(model)), "chat_template.jinja", "cannot read as UTF-8")


def test_generation_config_bad_eos(tmp_path):
    model = make_model(tmp_path / "m")
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [62, "eot"]}))
    assert_clean_error(run_cli(generate_args(model)), "generation_config.json", "eos_token_id must be an integer")


def test_tokenizer_larger_than_model_vocab(tmp_path):
    """A tokenizer for another model: its ids run past config.json's vocab_size; generation must refuse them."""
    model = make_model(tmp_path / "m")
    write_tokenizer(model, words=[f"w{i}" for i in range(100)])
    assert_clean_error(run_cli(generate_args(model, prompt="w1 w90")), "token id 90 is outside the vocabulary [0, 64)")
