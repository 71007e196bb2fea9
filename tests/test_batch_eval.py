"""`llama32 batch --eval`: the answer metrics on hand-checked cases, and the answer loss against HF transformers'
own teacher-forced cross-entropy (labels with the prompt masked) on a toy checkpoint."""
import json
import math

import numpy as np
import pytest

from tests._badinput import run_cli
from tools.batch_eval import (edit_distance, exact_match, final_answer, is_latex, last_number,
                              normalised_edit_distance, summarize)
from tools.toy import TOYS, write_toy_checkpoint


@pytest.mark.parametrize("text, number", [
    ("so she has 1,234 apples", 1234.0), ("it costs $12.50 in total.", 12.5), ("-3 then 4", 4.0),
    ("no digits here", None), ("The answer is 72.", 72.0), ("temperature -7", -7.0),
])
def test_last_number(text, number):
    assert last_number(text) == number


@pytest.mark.parametrize("text, answer, match", [
    ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "72", True),
    ("She pays $1,200 in rent.", "1200", True),
    ("The answer is 1200 dollars", "$1,200", True),
    ("first 72, then corrected: 71", "72", False),  # the last number counts
    ("She made 18 dollars", "He has 3 + 15 = 18 left\n#### 18", True),  # a GSM8K reference's final answer
    ("\\boxed{\\frac{1}{2}} so 5", "\\frac{1}{2}", True),  # \boxed{} wins over later text
    ("Paris.", "paris", True),
    ("The answer is:  New   York", "new york", True),
    ("London", "Paris", False),
    ("no number", "5", False),
])
def test_exact_match(text, answer, match):
    assert exact_match(text, answer) is match


def test_final_answer_balances_braces():
    assert final_answer("x = \\boxed{\\sqrt{a^{2}}} done") == "\\sqrt{a^{2}}"


@pytest.mark.parametrize("a, b, d", [("kitten", "sitting", 3), ("", "abc", 3), ("flaw", "lawn", 2),
                                     ("same", "same", 0), ("ab", "ba", 2)])
def test_edit_distance(a, b, d):
    assert edit_distance(a, b) == d == edit_distance(b, a)


def test_normalised_edit_distance_ignores_spacing_and_dollars():
    assert is_latex("x^{2}") and not is_latex("42")
    assert normalised_edit_distance("$x ^ {2}$", "x^{2}") == 0.0
    assert normalised_edit_distance("x^{3}", "x^{2}") == pytest.approx(1 / 5)
    assert normalised_edit_distance("xyz", "\\alpha") == 1.0  # nothing shared: 6 edits over 6 characters


def test_summary_weights_loss_by_tokens():
    s = summarize([{"exact_match": True, "loss": 1.0, "answer_tokens": 1},
                   {"exact_match": False, "loss": 4.0, "answer_tokens": 3, "edit_distance": 0.5}])
    assert s["exact_match"] == 0.5 and s["edit_distance"] == 0.5 and s["edit_distance_requests"] == 1
    assert s["loss"] == pytest.approx(13 / 4) and s["perplexity"] == pytest.approx(math.exp(13 / 4))


@pytest.mark.parametrize("backend", ["refimpl", "accel"])
def test_eval_loss_matches_hf_cross_entropy(tmp_path, backend):
    """The answer loss by the refimpl's forward, and by accel's (fp32 on CPU), against HF's own loss."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model_dir = write_toy_checkpoint(TOYS[0], tmp_path)
    lines = [{"id": "raw", "prompt": "the cat sat on", "answer": " the mat", "max_tokens": 4},
             {"id": "chat", "messages": [{"role": "user", "content": "and then"}], "answer": "the end",
              "max_tokens": 3}]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "out.jsonl"
    if backend == "accel":
        pytest.importorskip("accel.batch")
    r = run_cli(["batch", "--model", model_dir, "--input", inp, "--output", out, "--backend", backend, "--eval",
                 "--json", *(["--dtype", "fp32"] if backend == "accel" else [])])
    assert r.exit_code == 0, r.output
    records = [json.loads(x) for x in out.read_text().splitlines()]
    hf = transformers.LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    losses, counts = [], []
    for line, rec in zip(lines, records):
        prompt = (hf_tok.apply_chat_template(line["messages"], add_generation_prompt=True, tokenize=False)
                  if "messages" in line else line["prompt"])
        prompt_ids = hf_tok(prompt, add_special_tokens="messages" not in line)["input_ids"]
        answer_ids = hf_tok(line["answer"], add_special_tokens=False)["input_ids"]
        ids = torch.tensor([prompt_ids + answer_ids])
        labels = ids.clone()
        labels[0, :len(prompt_ids)] = -100  # score the answer only
        with torch.no_grad():
            loss = hf(input_ids=ids, labels=labels).loss.item()
        assert rec["eval"]["loss"] == pytest.approx(loss, rel=1e-4, abs=1e-5), line["id"]
        assert rec["eval"]["answer_tokens"] == len(answer_ids)
        assert rec["eval"]["exact_match"] == exact_match(rec["text"], line["answer"])
        losses.append(loss)
        counts.append(len(answer_ids))
    s = json.loads(r.stdout)["eval"]
    assert s["evaluated"] == 2
    assert s["loss"] == pytest.approx(np.dot(losses, counts) / sum(counts), rel=1e-4)
    assert s["perplexity"] == pytest.approx(math.exp(s["loss"]), rel=1e-9)


def test_eval_summary_printed(tmp_path):
    model_dir = write_toy_checkpoint(TOYS[0], tmp_path)
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"id": "a", "prompt": "the cat", "answer": "x^{2}", "max_tokens": 3}) + "\n")
    r = run_cli(["batch", "--model", model_dir, "--input", inp, "--output", tmp_path / "o.jsonl",
                 "--backend", "refimpl", "--eval"])
    assert r.exit_code == 0, r.output
    assert "eval: 1 requests, exact match 0.0%, edit distance" in r.stdout and "perplexity" in r.stdout


def test_final_answer_skips_an_empty_mark():
    assert final_answer("The answer is 7. Check: the answer is:") == "7. Check: the answer is:"
