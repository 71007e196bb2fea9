"""Training data: label masking against HF's apply_chat_template (the oracle), and every bad input of finetune.

The oracle's labels come from HF's own rendering + tokenization: the ids of the full conversation, with everything up
to the length of `messages[:-1]` rendered with the generation prompt set to -100.
"""
import json

import pytest

from _badinput import assert_clean_error, run_cli
from refimpl.text.tokenizer import TextTokenizer
from refimpl.train.data import encode_conversation, load_samples, read_conversations
from test_finetune import CONVERSATIONS, as_messages, finetune_args, hf_chat_model, hf_labels, init_adapter, \
    write_jsonl

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# ChatML with a default system prompt and a trailing newline after each turn (SmolLM2's shape): the trained span
# then ends with '<|im_end|>' and '\n', and the prompt rendering holds a system turn the data never had
CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\\nYou are a helpful AI assistant.<|im_end|>\\n' }}{% endif %}"
          "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("finetune-data") / "base"
    return path, hf_chat_model(path)


@pytest.mark.parametrize("template", ["llama3", "chatml"])
def test_labels_match_hf_apply_chat_template(base, tmp_path, template):
    path, _ = base
    if template == "chatml":
        d = json.loads((path / "tokenizer_config.json").read_text())
        path = tmp_path / "chatml"
        path.mkdir()
        for f in ("config.json", "tokenizer.json"):
            (path / f).write_bytes((base[0] / f).read_bytes())
        (path / "tokenizer_config.json").write_text(json.dumps({**d, "chat_template": CHATML}))
    ours = TextTokenizer.from_dir(path)
    theirs = transformers.AutoTokenizer.from_pretrained(path)
    for record in CONVERSATIONS:
        messages = as_messages(record)
        ids, labels = encode_conversation(ours, messages)
        want_ids, want_labels = hf_labels(theirs, messages)
        assert ids == want_ids and labels == want_labels
        trained = [t for t in labels if t != -100]
        assert 0 < len(trained) < len(ids)
        assert theirs.decode(trained).startswith(messages[-1]["content"])


def test_reads_both_record_forms(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", CONVERSATIONS)
    got = [messages for _, messages in read_conversations(path)]
    assert got == [as_messages(r) for r in CONVERSATIONS]


def test_overlong_samples_are_skipped_with_a_warning(base, tmp_path):
    path, _ = base
    long = {"query": "the " * 200, "response": "ok"}
    data = write_jsonl(tmp_path / "d.jsonl", [CONVERSATIONS[0], long, CONVERSATIONS[1]])
    warnings = []
    samples = load_samples(data, TextTokenizer.from_dir(path), 64, warnings.append)
    assert [s.line for s in samples] == [1, 3]
    assert len(warnings) == 1 and "line 2" in warnings[0] and "skipped 1" in warnings[0]


BAD_DATA = {
    "malformed line": ([json.dumps(CONVERSATIONS[0]), '{"messages": [', json.dumps(CONVERSATIONS[1])],
                       ["d.jsonl:2", "not valid JSON"]),
    "no assistant turn": ([json.dumps({"messages": [{"role": "user", "content": "hi"}]})],
                          ["d.jsonl:1", "no final assistant turn"]),
    "assistant not last": ([json.dumps({"messages": [{"role": "assistant", "content": "a"},
                                                     {"role": "user", "content": "b"}]})],
                           ["d.jsonl:1", "last role is 'user'"]),
    "bad role": ([json.dumps({"messages": [{"role": "robot", "content": "a"}]})], ["d.jsonl:1", "message 0"]),
    "neither form": ([json.dumps({"prompt": "a", "completion": "b"})], ["d.jsonl:1", "'messages'"]),
    "images": ([json.dumps({**CONVERSATIONS[0], "images": ["a.png"]})], ["d.jsonl:1", "image samples"]),
    "empty file": ([""], ["d.jsonl", "no samples"]),
    "every sample too long": ([json.dumps({"query": "the " * 200, "response": "ok"})],
                              ["d.jsonl:1", "longer than --max-length 64", "skipped, not truncated"]),
}


@pytest.mark.parametrize("case", list(BAD_DATA))
def test_bad_data_is_one_clear_error(base, tmp_path, case):
    lines, expected = BAD_DATA[case]
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(lines) + "\n")
    result = run_cli(finetune_args(base[0], data, tmp_path / "out", "--max-length", 64))
    assert_clean_error(result, *expected)
    assert not (tmp_path / "out").exists()


def test_init_adapter_for_another_model_is_refused(base, tmp_path):
    other = hf_chat_model(tmp_path / "other", layers=3)
    init_adapter(other, tmp_path / "adapter", ["q_proj", "v_proj"])
    data = write_jsonl(tmp_path / "d.jsonl", CONVERSATIONS)
    result = run_cli(finetune_args(base[0], data, tmp_path / "out", "--init-adapter", tmp_path / "adapter"))
    assert_clean_error(result, "adapter", "another base")


@pytest.mark.parametrize("args,expected", [
    (["--target", "q_proj,lm_head"], "--target: unknown module 'lm_head'"),
    (["--rank", "0"], "--rank must be a positive integer"),
    (["--dropout", "1"], "--dropout must be in [0, 1)"),
    (["--grad-accum", "0"], "--grad-accum must be a positive integer"),
])
def test_bad_options(base, tmp_path, args, expected):
    data = write_jsonl(tmp_path / "d.jsonl", CONVERSATIONS)
    assert_clean_error(run_cli(finetune_args(base[0], data, tmp_path / "out", *args)), expected)


def test_missing_data_file(base, tmp_path):
    assert_clean_error(run_cli(finetune_args(base[0], tmp_path / "nope.jsonl", tmp_path / "out")),
                       "nope.jsonl", "no such file")
