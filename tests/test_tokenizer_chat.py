"""Tokenizer, chat template and stop ids against HF transformers' tokenizer (the independent oracle)."""
import json

import pytest

from refimpl.formats.checkpoint import load_checkpoint
from refimpl.text.tokenizer import TextTokenizer
from tools.toy import TOYS, special_id, write_toy_checkpoint

transformers = pytest.importorskip("transformers")

MESSAGES = [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_toy_checkpoint(TOYS[0], tmp_path_factory.mktemp("toy"))


def hf_tokenizer(model_dir):
    return transformers.PreTrainedTokenizerFast.from_pretrained(str(model_dir))


def test_chat_ids_equal_hf_apply_chat_template_single_bos(model_dir):
    ours = load_checkpoint(model_dir).tokenizer.encode_chat(MESSAGES)
    theirs = hf_tokenizer(model_dir).apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    theirs = theirs["input_ids"] if isinstance(theirs, dict) or hasattr(theirs, "keys") else theirs
    assert ours == list(theirs)
    bos = special_id("<|begin_of_text|>")
    assert ours[0] == bos and ours.count(bos) == 1


def test_plain_prompt_gets_one_bos(model_dir):
    tok = load_checkpoint(model_dir).tokenizer
    ids = tok.encode("the cat")
    assert ids == hf_tokenizer(model_dir)("the cat")["input_ids"]
    assert ids[0] == special_id("<|begin_of_text|>") and ids.count(ids[0]) == 1
    # text that already starts with BOS still gets exactly one
    assert tok.encode("<|begin_of_text|>the cat") == ids


def test_builtin_llama3_format_when_no_template(model_dir, tmp_path):
    with_template = load_checkpoint(model_dir).tokenizer.render_chat(MESSAGES)
    cfg_path = model_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    del cfg["chat_template"]
    (tmp_path / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = TextTokenizer.from_dir(tmp_path)
    assert tok.chat_template is None
    # the toy template is Llama 3's header format, so the built-in one must render the same text
    assert tok.render_chat(MESSAGES) == with_template
    assert with_template.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n")
    assert with_template.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_chat_template_jinja_file_wins(model_dir, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((model_dir / name).read_bytes())
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}{% for m in messages %}[{{ m['content'] }}]"
                                                  "{% endfor %}")
    assert TextTokenizer.from_dir(tmp_path).render_chat(MESSAGES) == (
        "<|begin_of_text|>[Answer briefly.][What is the capital of France?]")


def test_stop_ids_include_every_eos(model_dir):
    ckpt = load_checkpoint(model_dir)
    for token in ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"):
        assert special_id(token) in ckpt.stop_ids
