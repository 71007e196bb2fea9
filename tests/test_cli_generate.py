"""`llama32 generate` end to end on a toy checkpoint, through click (as a user or a script calls it)."""
import json

import pytest
from click.testing import CliRunner

from refimpl.formats.checkpoint import load_checkpoint
from refimpl.generate import RefEngine, Sampling
from tools.cli import main
from tools.toy import TOYS, write_toy_checkpoint


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_toy_checkpoint(TOYS[0], tmp_path_factory.mktemp("toy"))


def run(*args):
    result = CliRunner().invoke(main, list(args))
    return result


def test_json_record_matches_engine(model_dir):
    r = run("generate", "--model", str(model_dir), "--backend", "refimpl", "--max-new-tokens", "12", "--json",
            "the cat sat on")
    assert r.exit_code == 0, r.output
    rec = json.loads(r.output)
    ckpt = load_checkpoint(model_dir)
    expected = list(RefEngine(ckpt).generate(rec["prompt_ids"], Sampling(max_new_tokens=12), ckpt.stop_ids))
    assert rec["generated_ids"] == expected
    assert rec["prompt_ids"] == ckpt.tokenizer.encode("the cat sat on")
    assert rec["text"] == ckpt.tokenizer.decode(expected)
    assert rec["timings"]["generated_tokens"] == len(expected) and rec["timings"]["prefill_s"] > 0


def test_stream_prints_text_and_speed(model_dir):
    r = run("generate", "--model", str(model_dir), "--backend", "refimpl", "--max-new-tokens", "8", "--chat",
            "hello")
    assert r.exit_code == 0, r.output
    assert "tok/s" in r.output and "[refimpl]" in r.output


def test_seed_repeats_and_changes_tokens(model_dir):
    def ids(seed):
        r = run("generate", "--model", str(model_dir), "--backend", "refimpl", "--max-new-tokens", "16",
                "--temperature", "1.5", "--seed", str(seed), "--json", "the")
        return json.loads(r.output)["generated_ids"]
    assert ids(3) == ids(3)
    assert ids(3) != ids(4)


def test_stops_on_eos(model_dir):
    ckpt = load_checkpoint(model_dir)
    prompt = ckpt.tokenizer.encode("the")
    greedy = list(RefEngine(ckpt).generate(prompt, Sampling(max_new_tokens=10)))
    # make the 3rd greedy token a stop id: generation must end right there
    stopped = list(RefEngine(ckpt).generate(prompt, Sampling(max_new_tokens=10), stop_ids=(greedy[2],)))
    assert stopped == greedy[:greedy.index(greedy[2]) + 1]


def test_bad_argument_is_one_line(model_dir):
    r = run("generate", "--model", str(model_dir), "--backend", "refimpl", "--top-p", "0", "x")
    assert r.exit_code == 2 and r.output.strip().startswith("error:") and "--top-p" in r.output
    assert "Traceback" not in r.output
