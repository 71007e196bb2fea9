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


# ---- the formats datasets ship in: alpaca, sharegpt, math, and --columns --------------------------------------

SHIPPED = [  # (record, the conversation it means, written out by hand)
    ({"instruction": "Name a colour.", "input": "", "output": "Red."},
     [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Red."}]),
    ({"instruction": "Translate.", "input": "le chat", "output": "the cat", "system": "Be exact."},
     [{"role": "system", "content": "Be exact."}, {"role": "user", "content": "Translate.\n\nle chat"},
      {"role": "assistant", "content": "the cat"}]),
    ({"conversations": [{"from": "system", "value": "Be short."}, {"from": "human", "value": "hi"},
                        {"from": "gpt", "value": "hello"}, {"from": "human", "value": "and?"},
                        {"from": "gpt", "value": "the end"}]},
     [{"role": "system", "content": "Be short."}, {"role": "user", "content": "hi"},
      {"role": "assistant", "content": "hello"}, {"role": "user", "content": "and?"},
      {"role": "assistant", "content": "the end"}]),
    ({"input": "Tom has 3 apples and eats 1. How many are left?", "output": "3 - 1 = 2 apples are left.",
      "answer": "2"},
     [{"role": "user", "content": "Tom has 3 apples and eats 1. How many are left?"},
      {"role": "assistant", "content": "3 - 1 = 2 apples are left.\n#### 2"}]),
    ({"input": "2 + 2?", "output": "2 + 2 = 4\n#### 4", "answer": 4},  # the answer line already there
     [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "2 + 2 = 4\n#### 4"}]),
]


def test_shipped_formats_read_as_their_conversations(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [r for r, _ in SHIPPED])
    assert [m for _, m in read_conversations(path)] == [m for _, m in SHIPPED]


def test_shipped_formats_train_on_hf_labels(base, tmp_path):
    """Labels of each format's record = HF apply_chat_template's labels of the conversation it means."""
    path, _ = base
    data = write_jsonl(tmp_path / "d.jsonl", [r for r, _ in SHIPPED])
    theirs = transformers.AutoTokenizer.from_pretrained(path)
    samples = load_samples(data, TextTokenizer.from_dir(path), 512)
    for sample, (_, messages) in zip(samples, SHIPPED):
        assert (sample.ids, sample.labels) == tuple(hf_labels(theirs, messages))


@pytest.mark.parametrize("spec", ['{"question": "query", "solution": "response", "sys": "system"}',
                                  "question=query, solution=response,sys=system"])
def test_columns_map_other_field_names(tmp_path, spec):
    from refimpl.train.data import parse_columns
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "q?", "solution": "s.", "sys": "S"}])
    assert [m for _, m in read_conversations(path, parse_columns(spec))] == [[
        {"role": "system", "content": "S"}, {"role": "user", "content": "q?"}, {"role": "assistant", "content": "s."}]]


def test_finetune_trains_on_alpaca_and_mapped_columns(base, tmp_path):
    alpaca = write_jsonl(tmp_path / "a.jsonl", [r for r, _ in SHIPPED])
    r = run_cli(finetune_args(base[0], alpaca, tmp_path / "out", "--max-steps", 1, "--json"))
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout.splitlines()[-1])["done"]
    other = write_jsonl(tmp_path / "o.jsonl", [{"question": "q?", "solution": "s."}])
    assert_clean_error(run_cli(finetune_args(base[0], other, tmp_path / "o1")), "o.jsonl:1",
                       "expected the fields of one format", "'question', 'solution'")
    r = run_cli(finetune_args(base[0], other, tmp_path / "o2", "--max-steps", 1, "--columns",
                              '{"question": "query", "solution": "response"}'))
    assert r.exit_code == 0, r.output


BAD_SHIPPED = {
    "alpaca output not a string": ({"instruction": "a", "output": 3}, ["d.jsonl:2", "field 'output' must be a string"]),
    "alpaca input not a string": ({"instruction": "a", "input": ["x"], "output": "b"},
                                  ["d.jsonl:2", "field 'input' must be a string"]),
    "sharegpt unknown speaker": ({"conversations": [{"from": "human", "value": "a"}, {"from": "bot", "value": "b"}]},
                                 ["d.jsonl:2", "field 'conversations', turn 1", "'from': one of"]),
    "sharegpt empty": ({"conversations": []}, ["d.jsonl:2", "field 'conversations' must be a non-empty list"]),
    "sharegpt ends with the human": ({"conversations": [{"from": "human", "value": "a"}]},
                                     ["d.jsonl:2", "no final assistant turn"]),
    "math answer not a value": ({"input": "a", "output": "b", "answer": [1]},
                                ["d.jsonl:2", "field 'answer' must be a string or a number"]),
    "columns collide": ({"question": "a", "query": "b", "response": "c"},
                        ["d.jsonl:2", "field 'question' maps to 'query'"]),
}


@pytest.mark.parametrize("case", list(BAD_SHIPPED))
def test_bad_shipped_records_name_file_line_and_field(base, tmp_path, case):
    record, expected = BAD_SHIPPED[case]
    data = write_jsonl(tmp_path / "d.jsonl", [SHIPPED[0][0], record])
    result = run_cli(finetune_args(base[0], data, tmp_path / "out", "--columns", "question=query"))
    assert_clean_error(result, *expected)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("spec, expected", [("question=nothing", "'question' maps to 'nothing'; expected one of"),
                                            ("{bad json", "not a valid JSON object"),
                                            ("question", "expected THEIR=OURS pairs")])
def test_bad_columns(base, tmp_path, spec, expected):
    data = write_jsonl(tmp_path / "d.jsonl", [SHIPPED[0][0]])
    assert_clean_error(run_cli(finetune_args(base[0], data, tmp_path / "out", "--columns", spec)), "--columns",
                       expected)


# ---- --out, --device, progress, and what is checked before torch -----------------------------------------------

def test_out_holding_an_adapter_or_a_model_is_refused_unless_overwrite_or_resume(base, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", CONVERSATIONS[:2])
    out = tmp_path / "out"
    assert run_cli(finetune_args(base[0], data, out, "--max-steps", 1)).exit_code == 0
    first = (out / "adapter_model.safetensors").read_bytes()
    assert_clean_error(run_cli(finetune_args(base[0], data, out, "--max-steps", 1)), f"--out {out}",
                       "holds a PEFT adapter", "--overwrite")
    assert (out / "adapter_model.safetensors").read_bytes() == first  # untouched
    assert_clean_error(run_cli(finetune_args(base[0], data, base[0], "--max-steps", 1)), "holds a model checkpoint")
    assert not (base[0] / "adapter_config.json").exists()
    (tmp_path / "file").write_text("x")
    assert_clean_error(run_cli(finetune_args(base[0], data, tmp_path / "file")), "is not a directory")
    # continuing the adapter in place is explicit enough; so is --overwrite
    assert run_cli(finetune_args(base[0], data, out, "--max-steps", 1, "--init-adapter", out)).exit_code == 0
    assert (out / "adapter_model.safetensors").read_bytes() != first
    r = run_cli(finetune_args(base[0], data, out, "--max-steps", 1, "--overwrite", "--seed", 3))
    assert r.exit_code == 0, r.output
    (tmp_path / "empty").mkdir()
    assert run_cli(finetune_args(base[0], data, tmp_path / "empty", "--max-steps", 1)).exit_code == 0


def test_progress_on_stderr_without_json(base, tmp_path):
    """Off a terminal: a line for the first step and the last (step/total, loss, lr, tokens per s); --json keeps
    stderr free of them (its records carry the same)."""
    data = write_jsonl(tmp_path / "d.jsonl", CONVERSATIONS)
    r = run_cli(finetune_args(base[0], data, tmp_path / "out", "--max-steps", 3))
    assert r.exit_code == 0, r.output
    lines = [line for line in r.stderr.splitlines() if line.startswith("finetune step: ")]
    assert [line.split()[2] for line in lines] == ["1/3", "3/3"], r.stderr
    assert all(" loss " in line and " lr " in line and "tok/s" in line for line in lines)
    assert r.stderr.startswith("finetune: 4 samples, 3 steps on cpu")
    r = run_cli(finetune_args(base[0], data, tmp_path / "out2", "--max-steps", 1, "--json"))
    assert r.exit_code == 0 and "finetune" not in r.stderr, r.stderr


def test_gptq_quantize_shows_per_layer_progress(tmp_path):
    from tools.debug.golden import DEFAULT_DIR
    r = run_cli(["quantize", "--model", DEFAULT_DIR / "toy-gqa", "--quant", "int8", "--method", "gptq", "--out",
                 tmp_path / "q"])
    assert r.exit_code == 0, r.output
    lines = [line for line in r.stderr.splitlines() if line.startswith("quantizing to int8 (gptq")]
    assert [line.split(": ")[1].split()[0] for line in lines] == ["1/4", "2/4", "3/4", "4/4"], r.stderr
    assert [line.split()[-1] for line in lines] == ["0", "1", "2", "lm_head"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cuda_device_without_cuda_is_one_error_line(base, tmp_path, device):
    data = write_jsonl(tmp_path / "d.jsonl", CONVERSATIONS)
    assert_clean_error(run_cli(finetune_args(base[0], data, tmp_path / "out") + ["--device", device]),
                       f"--device {device}", "no CUDA device", "--device cpu")


PROBE = """
import sys
from tools.cli import main
try:
    main(sys.argv[1:], standalone_mode=False)
except SystemExit as e:
    print("exit", e.code)
print("torch imported:", "torch" in sys.modules)
"""


@pytest.mark.parametrize("case", ["missing file", "bad record", "bad option"])
def test_bad_data_is_reported_before_torch_is_imported(base, tmp_path, case):
    import subprocess
    import sys
    data = {"missing file": tmp_path / "nope.jsonl",
            "bad record": write_jsonl(tmp_path / "d.jsonl", [{"instruction": "a"}])}.get(case, tmp_path / "d.jsonl")
    extra = ["--rank", "0"] if case == "bad option" else []
    r = subprocess.run([sys.executable, "-c", PROBE, "finetune", "--model", str(base[0]), "--data", str(data),
                        "--out", str(tmp_path / "out"), *extra], capture_output=True, text=True, timeout=120)
    assert "exit 2" in r.stdout and "torch imported: False" in r.stdout, r.stdout + r.stderr
    assert r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, r.stderr
