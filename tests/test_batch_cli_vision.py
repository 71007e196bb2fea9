"""`llama32 batch` on a Llama 3.2 Vision checkpoint (golden/toy-vision): lines with "images" (raw prompts and chat
messages), text-only lines beside them, each request's greedy ids exactly those `llama32 generate --image --json`
gives it alone; bad image lines named FILE:LINE before any work."""
import importlib.util
import json
import shutil

import pytest

from tests._badinput import assert_clean_error, run_cli
from tools.debug.golden_record import DEFAULT_DIR

TOY = DEFAULT_DIR / "toy-vision"
HAS_ACCEL_BATCH = importlib.util.find_spec("torch") is not None and importlib.util.find_spec("accel.batch") is not None
BACKENDS = ["refimpl", pytest.param("accel", marks=pytest.mark.skipif(not HAS_ACCEL_BATCH,
                                                                        reason="accel.batch not present"))]


def write_lines(path, *objs):
    path.write_text("".join(json.dumps(o) + "\n" for o in objs))
    return path


def generate_json(prompt, n, *extra):
    r = run_cli(["generate", prompt, "--model", TOY, "--backend", "refimpl", "--max-new-tokens", n, "--json", *extra])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


@pytest.mark.parametrize("backend", BACKENDS)
def test_image_lines_equal_generate_image_json(tmp_path, backend):
    shutil.copy(TOY / "image.png", tmp_path / "sea.png")  # paths are relative to the input file
    lines = [
        {"id": "raw", "prompt": "Look at this picture: <|image|> and tell me about the sea in it.",
         "images": ["sea.png"], "max_tokens": 7},
        {"id": "text", "prompt": "a prompt without any picture", "max_tokens": 5},
        {"id": "chat", "messages": [{"role": "user", "content": "What is this?"}], "images": ["sea.png"],
         "max_tokens": 6},
        {"id": "first", "prompt": "Tell me about it.", "images": ["sea.png"], "max_tokens": 4},
    ]
    inp = write_lines(tmp_path / "in.jsonl", *lines)
    out = tmp_path / "out.jsonl"
    r = run_cli(["batch", "--model", TOY, "--input", inp, "--output", out, "--backend", backend,
                 "--max-num-batched-tokens", "16", "--device", "cpu"])  # fp32 on the CPU: exact ids, as the refimpl
    assert r.exit_code == 0, r.output
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [rec["id"] for rec in records] == [line["id"] for line in lines]
    image = ["--image", tmp_path / "sea.png"]
    wants = [generate_json(lines[0]["prompt"], 7, *image, "--no-chat"),
             generate_json(lines[1]["prompt"], 5, "--no-chat"),
             generate_json("What is this?", 6, *image, "--chat"),
             generate_json(lines[3]["prompt"], 4, *image, "--no-chat")]
    for line, rec, want in zip(lines, records, wants):
        assert rec["generated_ids"] == want["generated_ids"], line["id"]
        assert rec["usage"]["prompt_tokens"] == len(want["prompt_ids"]), line["id"]
    # the image matters: the same text without it gives other tokens
    assert generate_json(lines[3]["prompt"], 4, "--no-chat")["generated_ids"] != records[3]["generated_ids"]


@pytest.mark.parametrize("line,expected", [
    ({"id": "x", "prompt": "<|image|> hi", "images": ["missing.png"]}, "missing.png"),
    ({"id": "x", "prompt": "<|image|> and <|image|>", "images": ["sea.png"]}, "2 <|image|> token(s) but 1 image"),
    ({"id": "x", "prompt": "no image token", "images": "sea.png"}, '"images" must be a list of image paths'),
])
def test_bad_image_lines_are_named(tmp_path, line, expected):
    shutil.copy(TOY / "image.png", tmp_path / "sea.png")
    inp = write_lines(tmp_path / "in.jsonl", {"id": "ok", "prompt": "fine"}, line)
    out = tmp_path / "out.jsonl"
    r = run_cli(["batch", "--model", TOY, "--input", inp, "--output", out, "--backend", "refimpl"])
    assert_clean_error(r, f"{inp}:2", expected)
    assert not out.exists() or not out.read_text()


def test_eval_and_lora_refused_on_vision(tmp_path):
    inp = write_lines(tmp_path / "in.jsonl", {"id": "ok", "prompt": "fine", "answer": "a"})
    r = run_cli(["batch", "--model", TOY, "--input", inp, "--output", tmp_path / "o.jsonl", "--eval"])
    assert_clean_error(r, "--eval", "Llama 3.2 Vision")
