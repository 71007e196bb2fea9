"""Quantized and merged copies of a checkpoint behave as their source: chat mode comes from what the checkpoint
records (its chat template and the names it carries), never from the name of the directory it was written to, and
every side file of the source (tokenizer, chat template, generation settings) comes along."""
import json
import shutil

import numpy as np
import pytest

from refimpl.formats.safetensors_io import save_safetensors
from tests._badinput import run_cli
from tools.debug.golden import DEFAULT_DIR
from tools.default_model import default_model_path

GQA = DEFAULT_DIR / "toy-gqa"
SIDE_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "chat_template.jinja")


@pytest.fixture(scope="module")
def instruct(tmp_path_factory):
    """toy-gqa published under an instruct name, with a special_tokens_map.json and a chat_template.jinja too."""
    model = shutil.copytree(GQA, tmp_path_factory.mktemp("src") / "Toy-GQA-Instruct")
    tcfg = json.loads((model / "tokenizer_config.json").read_text())
    (model / "chat_template.jinja").write_text(tcfg.pop("chat_template"))
    (model / "tokenizer_config.json").write_text(json.dumps(tcfg))
    (model / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<|begin_of_text|>"}))
    return model


def adapter(path):
    """A PEFT adapter on layer 0's q_proj of the toy (hidden 64)."""
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4,
                                                          "target_modules": ["q_proj"]}))
    rng = np.random.default_rng(0)
    p = "base_model.model.model.layers.0.self_attn.q_proj."
    save_safetensors(path / "adapter_model.safetensors", {p + "lora_A.weight": rng.standard_normal((2, 64)),
                                                          p + "lora_B.weight": rng.standard_normal((64, 2))})
    return path


def chats(model) -> bool:
    r = run_cli(["generate", "--model", model, "--backend", "refimpl", "--max-new-tokens", "2", "--json", "hi"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)["chat"]


def derive(kind, source, out, tmp_path):
    args = (["quantize", "--model", source, "--quant", "int8", "--method", "rtn", "--out", out] if kind == "quantize"
            else ["lora", "merge", "--model", source, "--adapter", adapter(tmp_path / "a"), "--out", out])
    r = run_cli(args)
    assert r.exit_code == 0, r.output
    return out


@pytest.mark.parametrize("kind", ["quantize", "merge"])
def test_a_derived_copy_of_an_instruct_model_chats_and_carries_its_files(tmp_path, instruct, kind):
    assert chats(instruct)
    out = derive(kind, instruct, tmp_path / "q8", tmp_path)
    assert chats(out)  # the directory's name says nothing; the copy records its source's
    for name in SIDE_FILES:
        assert (out / name).read_bytes() == (instruct / name).read_bytes(), name
    assert chats(out.rename(tmp_path / "anything"))


@pytest.mark.parametrize("kind", ["quantize", "merge"])
def test_a_derived_copy_of_a_base_model_completes(tmp_path, kind):
    assert not chats(GQA)
    assert not chats(derive(kind, GQA, tmp_path / "q8", tmp_path))


@pytest.mark.parametrize("name, chat", [("Toy 1B Instruct", True), ("Toy 1B", False), (None, False)])
def test_a_gguf_files_recorded_name_decides_and_its_quantized_copy_keeps_it(tmp_path, name, chat):
    """A GGUF under a name that says nothing ('model.gguf'): its general.name decides, and so does the quantized
    copy's recorded name, whatever the directory is called."""
    from refimpl.formats.params import random_params
    from tests.test_gguf import tiny_config, write_gguf
    cfg = tiny_config()
    path = write_gguf(tmp_path / "model.gguf", cfg, random_params(cfg, seed=0), name=name)
    assert chats(path) == chat
    assert chats(derive("quantize", path, tmp_path / "q", tmp_path)) == chat


def test_default_model_quantized_answers(tmp_path):
    """The issue's steps with the real default model (SmolLM2-135M-Instruct GGUF): quantize, then ask."""
    try:
        gguf = default_model_path(fetch_if_missing=False)
    except Exception:
        pytest.skip("the default model is not cached (llama32 fetch)")
    out = tmp_path / "q8"
    r = run_cli(["quantize", "--model", gguf, "--quant", "int8", "--method", "rtn", "--out", out])
    assert r.exit_code == 0, r.output
    r = run_cli(["generate", "What is the capital of France?", "--model", out, "--backend", "refimpl",
                 "--max-new-tokens", "12", "--json"])
    assert r.exit_code == 0, r.output
    rec = json.loads(r.stdout)
    assert rec["chat"] and rec["text"].strip() and "Paris" in rec["text"], rec["text"]
