"""`llama32 batch` end to end on toy checkpoints through click: request files checked line by line before any work,
results in input order, resume, stop strings, adapters, and the same greedy ids as `llama32 generate --json`.

Backends: refimpl (the NumPy engine one request at a time, always) and accel (accel.batch's continuous batching on
CPU torch ops, where that package is present)."""
import importlib.util
import json

import pytest

from refimpl.batch_api import RequestOutput
from refimpl.formats.checkpoint import load_checkpoint
from tests._badinput import assert_clean_error, run_cli
from tests._peft_adapters import make_adapters
from tools.batch_job import OrderedWriter, run_group, Tally
from tools.batch_requests import read_requests
from tools.toy import TOYS, write_toy_checkpoint

HAS_ACCEL_BATCH = importlib.util.find_spec("torch") is not None and importlib.util.find_spec("accel.batch") is not None
BACKENDS = ["refimpl", pytest.param("accel", marks=pytest.mark.skipif(not HAS_ACCEL_BATCH,
                                                                        reason="accel.batch not present"))]
PROMPTS = ["the cat sat on", "and then", "it is the end of the world and we", "s"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_toy_checkpoint(TOYS[0], tmp_path_factory.mktemp("toy"))


def write_lines(path, *objs):
    path.write_text("".join((o if isinstance(o, str) else json.dumps(o)) + "\n" for o in objs))
    return path


def batch(model_dir, inp, out, *extra, backend="refimpl"):
    return run_cli(["batch", "--model", model_dir, "--input", inp, "--output", out, "--backend", backend, *extra])


def read_out(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def generate_json(model_dir, prompt, n, *extra):
    r = run_cli(["generate", prompt, "--model", model_dir, "--backend", "refimpl", "--max-new-tokens", n,
                 "--json", *extra])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


# ---- bad request files: one error naming FILE:LINE, before any work ----
GOOD = {"id": "ok", "prompt": "the cat"}
BAD_LINES = {
    "not json": ('{"id": "x", "prompt": ', "not valid JSON"),
    "not an object": ('["x"]', "expected a JSON object"),
    "missing id": ({"prompt": "a"}, '"id" must be a non-empty string'),
    "id not a string": ({"id": 3, "prompt": "a"}, '"id" must be a non-empty string'),
    "duplicate id": ({"id": "ok", "prompt": "b"}, "duplicate id 'ok' (first on line 1)"),
    "no prompt": ({"id": "x"}, 'exactly one of "prompt"'),
    "prompt and messages": ({"id": "x", "prompt": "a", "messages": [{"role": "user", "content": "a"}]},
                            'exactly one of "prompt"'),
    "prompt not a string": ({"id": "x", "prompt": ["a"]}, '"prompt" must be a non-empty string'),
    "empty messages": ({"id": "x", "messages": []}, '"messages" must be a non-empty list'),
    "message without content": ({"id": "x", "messages": [{"role": "user"}]}, "messages[0] must be an object"),
    "unknown role": ({"id": "x", "messages": [{"role": "robot", "content": "a"}]}, "has role 'robot'"),
    "max_tokens zero": ({"id": "x", "prompt": "a", "max_tokens": 0}, '"max_tokens" must be a positive integer'),
    "max_tokens float": ({"id": "x", "prompt": "a", "max_tokens": 2.5}, '"max_tokens" must be a positive integer'),
    "temperature negative": ({"id": "x", "prompt": "a", "temperature": -1}, '"temperature" must be a number >= 0'),
    "temperature string": ({"id": "x", "prompt": "a", "temperature": "hot"}, '"temperature" must be a number'),
    "top_p zero": ({"id": "x", "prompt": "a", "top_p": 0}, '"top_p" must be a number in (0, 1]'),
    "top_k negative": ({"id": "x", "prompt": "a", "top_k": -2}, '"top_k" must be an integer >= 0'),
    "seed negative": ({"id": "x", "prompt": "a", "seed": -1}, '"seed" must be an integer'),
    "stop a number": ({"id": "x", "prompt": "a", "stop": 5}, '"stop" must be a non-empty string'),
    "unknown adapter": ({"id": "x", "prompt": "a", "adapter": "math"}, "unknown adapter 'math'"),
    "images on a text model": ({"id": "x", "prompt": "a", "images": ["cat.png"]}, "the model is text-only"),
    "unknown field": ({"id": "x", "prompt": "a", "max_new_tokens": 3}, "unknown field 'max_new_tokens'"),
    "answer not a string": ({"id": "x", "prompt": "a", "answer": 4}, '"answer" must be a string'),
    "prompt too long": ({"id": "x", "prompt": "the " * 200}, "fills the model's context of 128"),
}


@pytest.mark.parametrize("case", list(BAD_LINES))
def test_bad_line_is_named_before_any_work(model_dir, tmp_path, case):
    line, expected = BAD_LINES[case]
    inp = write_lines(tmp_path / "in.jsonl", GOOD, line)
    out = tmp_path / "out.jsonl"
    assert_clean_error(batch(model_dir, inp, out), f"{inp}:2:", expected)
    assert not out.exists()  # nothing ran, nothing written


def test_line_not_utf8_is_named(model_dir, tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(json.dumps(GOOD).encode() + b"\n" + b'{"id": "x", "prompt": "caf\xe9"}\n')  # Latin-1 e-acute
    out = tmp_path / "out.jsonl"
    assert_clean_error(batch(model_dir, inp, out), f"{inp}:2:", "not valid UTF-8")
    assert not out.exists()


def test_eval_needs_answers(model_dir, tmp_path):
    inp = write_lines(tmp_path / "in.jsonl", {**GOOD, "answer": "a"}, "", {"id": "y", "prompt": "b"})
    assert_clean_error(batch(model_dir, inp, tmp_path / "out.jsonl", "--eval"), f"{inp}:3:", '--eval needs')


@pytest.mark.parametrize("args, expected", [
    (["--lora", "nodir"], "expected NAME=DIR"),
    (["--lora", "a=x", "--lora", "a=y"], "adapter name 'a' given twice"),
    (["--gpu-memory", "1.5"], "--gpu-memory '1.5'"),
])
def test_bad_options(model_dir, tmp_path, args, expected):
    inp = write_lines(tmp_path / "in.jsonl", GOOD)
    assert_clean_error(batch(model_dir, inp, tmp_path / "out.jsonl", *args), expected)


def test_output_not_an_earlier_output(model_dir, tmp_path):
    inp = write_lines(tmp_path / "in.jsonl", GOOD)
    out = write_lines(tmp_path / "out.jsonl", {"id": "other", "text": ""})
    assert_clean_error(batch(model_dir, inp, out), f"{out}:1:", "id 'other' is not in the input file")


# ---- ordering: results in input order whatever order the engine finishes them ----
class ReverseEngine:
    """Finishes the requests last-added first, one token each, as a batch engine may (a short request overtakes a
    long one)."""

    def __init__(self):
        self.added = []

    def add_request(self, prompt_ids, params, request_id=None, adapter=None):
        self.added.append((request_id, params))
        return request_id

    def has_unfinished(self):
        return bool(self.added)

    def abort(self, rid):
        self.added = [a for a in self.added if a[0] != rid]

    def step(self):
        rid, params = self.added.pop()
        token = 7 + len(self.added)
        return [RequestOutput(rid, [token], [token], True, "length", 3)]


def test_results_written_in_input_order(tmp_path, model_dir):
    ckpt = load_checkpoint(model_dir)
    inp = write_lines(tmp_path / "in.jsonl", *({"id": f"r{i}", "prompt": "the cat"} for i in range(5)))
    reqs = read_requests(inp, ckpt.tokenizer, 128)
    out = tmp_path / "out.jsonl"
    engine = ReverseEngine()
    with open(out, "w") as f:
        writer = OrderedWriter(f, [r.id for r in reqs])
        seen = []

        def on_done(req, record):
            seen.append(req.id)
            writer.put(req.id, record)
            # nothing is written before r0, which the engine finishes last
            assert (out.stat().st_size == 0) == (req.id != "r0")
        run_group(engine, reqs, ckpt.tokenizer, ckpt.stop_ids, on_done, Tally())
    assert seen == ["r4", "r3", "r2", "r1", "r0"] and writer.complete
    records = read_out(out)
    assert [r["id"] for r in records] == ["r0", "r1", "r2", "r3", "r4"]
    assert [r["generated_ids"] for r in records] == [[7], [8], [9], [10], [11]]


# ---- end to end ----
@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_equals_generate_json(model_dir, tmp_path, backend):
    """Each request of a file of mixed lengths gets exactly the ids `llama32 generate --json` gives it alone."""
    lines = [{"id": f"p{i}", "prompt": p, "max_tokens": 5 + 3 * i} for i, p in enumerate(PROMPTS)]
    lines.append({"id": "chat", "messages": [{"role": "system", "content": "be brief"},
                                             {"role": "user", "content": "the end"}], "max_tokens": 9})
    inp = write_lines(tmp_path / "in.jsonl", *lines)
    out = tmp_path / "out.jsonl"
    r = batch(model_dir, inp, out, "--json", backend=backend)
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout)
    records = read_out(out)
    assert [rec["id"] for rec in records] == [line["id"] for line in lines]
    for line, rec in zip(lines, records):
        if "prompt" in line:
            want = generate_json(model_dir, line["prompt"], line["max_tokens"], "--no-chat")
        else:
            want = generate_json(model_dir, "the end", line["max_tokens"], "--chat", "--system", "be brief")
        assert rec["generated_ids"] == want["generated_ids"], line["id"]
        assert rec["text"] == want["text"]
        assert rec["usage"] == {"prompt_tokens": len(want["prompt_ids"]),
                                "completion_tokens": len(want["generated_ids"])}
        assert rec["finish_reason"] == ("stop" if want["stopped_on_eos"] else "length")
    assert summary["completed"] == len(lines) and summary["completion_tokens"] == sum(
        rec["usage"]["completion_tokens"] for rec in records)


def test_resume_skips_done_ids_and_drops_a_cut_line(model_dir, tmp_path):
    lines = [{"id": f"p{i}", "prompt": p, "max_tokens": 6} for i, p in enumerate(PROMPTS)]
    inp = write_lines(tmp_path / "in.jsonl", *lines)
    full = tmp_path / "full.jsonl"
    assert batch(model_dir, inp, full).exit_code == 0
    expected = read_out(full)
    # a run killed after two records, halfway through writing the third; the first record marked, to see that
    # the resumed run keeps it rather than recomputing it
    first, second, third = full.read_text().splitlines()[:3]
    marked = json.loads(first)
    marked["text"] = "KEPT"
    out = tmp_path / "out.jsonl"
    out.write_text(json.dumps(marked) + "\n" + second + "\n" + third[:20])
    r = batch(model_dir, inp, out, "--json")
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout)
    assert summary["resumed"] == 2 and summary["completed"] == 2
    got = read_out(out)
    assert got[0]["text"] == "KEPT" and got[1:] == expected[1:]
    # everything done: a third run does nothing
    r = batch(model_dir, inp, out, "--json")
    assert json.loads(r.stdout)["completed"] == 0 and read_out(out) == got


@pytest.mark.parametrize("backend", BACKENDS)
def test_stop_strings_cut_the_text(model_dir, tmp_path, backend):
    prompt = "it is the end of the world and we"
    inp = write_lines(tmp_path / "in.jsonl", {"id": "free", "prompt": prompt, "max_tokens": 12})
    assert batch(model_dir, inp, tmp_path / "free.jsonl").exit_code == 0
    free = read_out(tmp_path / "free.jsonl")[0]
    text = free["text"]
    assert len(text) > 4, text
    stop = text[2:4]  # a stop string that ends inside the generated text
    cut = text.find(stop)
    inp = write_lines(tmp_path / "in2.jsonl", {"id": "cut", "prompt": prompt, "max_tokens": 12,
                                               "stop": ["NEVER", stop]})
    assert batch(model_dir, inp, tmp_path / "cut.jsonl", backend=backend).exit_code == 0
    rec = read_out(tmp_path / "cut.jsonl")[0]
    assert rec["finish_reason"] == "stop" and rec["text"] == text[:cut]
    # generation stopped at the token that completed the stop string
    ids = rec["generated_ids"]
    assert ids == free["generated_ids"][:len(ids)]
    tok = load_checkpoint(model_dir).tokenizer
    assert stop in tok.decode(ids) and stop not in tok.decode(ids[:-1])


def test_max_tokens_lowered_to_fit_the_context(model_dir, tmp_path):
    prompt = "the " * 60
    inp = write_lines(tmp_path / "in.jsonl", {"id": "long", "prompt": prompt, "max_tokens": 500})
    r = batch(model_dir, inp, tmp_path / "out.jsonl")
    assert r.exit_code == 0, r.output
    n_prompt = len(load_checkpoint(model_dir).tokenizer.encode(prompt))
    assert f"max_tokens 500 lowered to {128 - n_prompt}" in r.stderr
    rec = read_out(tmp_path / "out.jsonl")[0]
    assert rec["usage"]["prompt_tokens"] + rec["usage"]["completion_tokens"] <= 128


@pytest.mark.parametrize("backend", BACKENDS)
def test_adapters_by_name_equal_generate_lora(model_dir, tmp_path, backend, monkeypatch):
    """Requests naming two adapters and none, interleaved: each gets `llama32 generate --lora DIR`'s ids. One pass
    over the file: accel builds one engine, and a step runs rows of both adapters and of the base model together;
    refimpl merges each adapter once (its requests one after another)."""
    dirs = make_adapters(model_dir, tmp_path, {"math": ["q_proj", "v_proj"], "ocr": ["o_proj", "down_proj"]})
    lines = [{"id": "m1", "prompt": "the cat sat on", "adapter": "math", "max_tokens": 8},
             {"id": "b1", "prompt": "the cat sat on", "max_tokens": 8},
             {"id": "o1", "prompt": "the cat sat on", "adapter": "ocr", "max_tokens": 8},
             {"id": "m2", "prompt": "and then", "adapter": "math", "max_tokens": 8}]
    inp = write_lines(tmp_path / "in.jsonl", *lines)
    out = tmp_path / "out.jsonl"
    built, steps = count_engines(monkeypatch, backend)
    r = batch(model_dir, inp, out, "--lora", f"math={dirs['math']}", "--lora", f"ocr={dirs['ocr']}", backend=backend)
    assert r.exit_code == 0, r.output
    if backend == "accel":
        assert len(built) == 1 and max(steps) == 3, (built, steps)  # math, ocr and base rows in one step
    else:
        assert built == ["math", None, "ocr"], built  # m1 then m2 under math, b1, o1
    records = read_out(out)
    assert [rec["id"] for rec in records] == [line["id"] for line in lines]
    got = {rec["id"]: rec["generated_ids"] for rec in records}
    for line in lines:
        extra = ["--lora", dirs[line["adapter"]]] if "adapter" in line else []
        want = generate_json(model_dir, line["prompt"], line["max_tokens"], "--no-chat", *extra)
        assert got[line["id"]] == want["generated_ids"], line["id"]
    assert len({tuple(got["m1"]), tuple(got["b1"]), tuple(got["o1"])}) == 3, got  # the adapters change the tokens


def count_engines(monkeypatch, backend):
    """-> (a list growing by each engine `llama32 batch` builds: accel's BatchEngine, or the adapter of each refimpl
    engine; the number of adapters, the base model counted as one, among each accel step's rows)."""
    built, steps = [], []
    if backend == "accel":
        from accel.batch import BatchEngine
        from accel.batch.runner import ModelRunner
        make, prepare = BatchEngine.from_checkpoint.__func__, ModelRunner.prepare
        monkeypatch.setattr(BatchEngine, "from_checkpoint",
                            classmethod(lambda cls, *a, **k: built.append(cls) or make(cls, *a, **k)))

        def counting_prepare(self, batch):
            steps.append(len({s.seq.adapter for s in batch}))
            return prepare(self, batch)
        monkeypatch.setattr(ModelRunner, "prepare", counting_prepare)
    else:
        from tools.batch_engines import OneAtATime
        init = OneAtATime.__init__

        def recording_init(self, engine_for, eos_ids=()):
            init(self, lambda name: built.append(name) or engine_for(name), eos_ids)
        monkeypatch.setattr(OneAtATime, "__init__", recording_init)
    return built, steps


def test_default_model_batch_equals_generate(tmp_path):
    """The real default model (SmolLM2-135M-Instruct GGUF) on CPU, where it has been fetched, with the backend a
    newcomer gets (auto: the batch engine where torch is installed), against `generate --json` on the refimpl."""
    from tools.default_model import default_model_path
    from refimpl.errors import Llama32Error
    try:
        model = default_model_path(fetch_if_missing=False)
    except Llama32Error:
        pytest.skip("the default model is not fetched (llama32 fetch)")
    lines = [{"id": "chat", "messages": [{"role": "user", "content": "What is 2 + 3?"}], "max_tokens": 6},
             {"id": "raw", "prompt": "The capital of France is", "max_tokens": 6}]
    inp = write_lines(tmp_path / "in.jsonl", *lines)
    out = tmp_path / "out.jsonl"
    r = batch(model, inp, out, backend="auto")
    assert r.exit_code == 0, r.output
    records = read_out(out)
    chat = generate_json(model, "What is 2 + 3?", 6, "--chat")
    raw = generate_json(model, "The capital of France is", 6, "--no-chat")
    assert [rec["generated_ids"] for rec in records] == [chat["generated_ids"], raw["generated_ids"]]


class _ScriptedEngine:
    """Yields a fixed token script, stopping after a token in stop_ids or at max_new_tokens (RefEngine's contract)."""

    def __init__(self, script):
        self.script = script

    def generate(self, prompt_ids, s, stop_ids=()):
        for n, token in enumerate(self.script):
            yield token
            if token in stop_ids or n + 1 == s.max_new_tokens:
                return


@pytest.mark.parametrize("ignore_eos, stop_token_ids, want, reason", [
    (False, (), [5, 2], "stop"),  # the checkpoint's eos (2) stops
    (True, (), [5, 2, 7, 9], "length"),  # ignore_eos: eos does not stop
    (True, (7,), [5, 2, 7], "stop"),  # ... but the request's own stop ids still do
])
def test_one_at_a_time_ignore_eos_keeps_the_requests_stop_ids(ignore_eos, stop_token_ids, want, reason):
    from refimpl.batch_api import SamplingParams
    from tools.batch_engines import OneAtATime

    engine = OneAtATime(lambda adapter: _ScriptedEngine([5, 2, 7, 9, 11]), eos_ids=(2,))
    engine.add_request([1], SamplingParams(max_tokens=4, ignore_eos=ignore_eos, stop_token_ids=stop_token_ids))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert outs[-1].token_ids == want and outs[-1].finish_reason == reason
