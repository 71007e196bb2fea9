"""Tensor parallelism (accel.tp) on the CPU over gloo, 2 ranks: greedy ids against HF transformers' generate, sampled
ids against the one-process engine, shard shapes and slice-only reads, golden logits, the CLI's --tp 2 against
--tp 1, and the refusals. One spawned group runs every case (tests/_tp_harness.py)."""
import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from transformers import LlamaConfig as HFConfig, LlamaForCausalLM

from accel.engine import AccelEngine
from accel.tp.group import free_port
from accel.tp.shard import ShardPlan, check_divisible, shard_elements
from refimpl.compare import TOLERANCES, compare
from refimpl.errors import ConfigError
from refimpl.formats.checkpoint import load_checkpoint, save_checkpoint
from refimpl.formats.params import expected_shapes, random_params
from refimpl.formats.safetensors_io import SafetensorsFile, save_safetensors
from refimpl.generate import RefEngine, Sampling
from refimpl.model.config import LlamaConfig
from tests._tp_harness import run_job
from tools.cli import main
from tools.toy import TOYS, ToySpec, write_toy_checkpoint

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "golden" / "toy-gqa"
PROMPT = [1, 7, 19, 3, 42, 11]
NEW = 8
SAMPLED = Sampling(max_new_tokens=NEW, temperature=1.3, top_k=20, seed=5)

# name: (attention heads, KV heads, vocab, tied): 2 divides the KV heads; MQA (1 KV head, replicated on both
# ranks); vocabularies 2 does not divide; tied and untied embeddings
MODELS = {"gqa_untied": (4, 2, 64, False), "mqa_tied_odd_vocab": (4, 1, 67, True),
          "gqa_tied_odd_vocab": (4, 2, 61, True)}


def hf_model(heads, kv_heads, vocab, tied):
    cfg = HFConfig(vocab_size=vocab, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=128,
                   tie_word_embeddings=tied, initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(vocab + kv_heads)
    return LlamaForCausalLM(cfg).eval()


def hf_greedy(model) -> list[int]:
    model.generation_config.eos_token_id = None  # NEW tokens, whatever they are
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    return out[0, len(PROMPT):].tolist()


def golden_steps() -> tuple[list[dict], int]:
    manifest = json.loads((GOLDEN / "golden.json").read_text())
    steps = [{"name": s["name"], "ids": s["ids"], "start": s["positions"][0]} for s in manifest["steps"]]
    return steps, steps[-1]["start"] + 1


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """name -> (model directory, HF's greedy ids)."""
    out = {}
    for name, spec in MODELS.items():
        model = hf_model(*spec)
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path)
        out[name] = (path, hf_greedy(model))
    return out


@pytest.fixture(scope="module")
def gguf_model(tmp_path_factory):
    """A Q8_0 GGUF file (q/k rows permuted as llama.cpp writes them, untied lm_head) and the refimpl's greedy ids."""
    from tests.test_gguf import Q, tiny_config, write_gguf
    cfg = tiny_config(tied=False)
    path = write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", cfg, random_params(cfg, seed=3, std=0.2),
                      qtype=Q.Q8_0)
    return path, list(RefEngine(load_checkpoint(path)).generate(PROMPT, Sampling(max_new_tokens=NEW)))


@pytest.fixture(scope="module")
def ranks(hf, gguf_model, tmp_path_factory):
    """Both ranks' results for every case, from one spawned group."""
    cases = {name: {"dir": str(path), "requests": [{"prompt": PROMPT, "max_new": NEW},
                                                    {"prompt": PROMPT, "max_new": NEW, "temperature": 1.3,
                                                     "top_k": 20, "seed": 5}]}
             for name, (path, _) in hf.items()}
    cases["gguf"] = {"dir": str(gguf_model[0]), "requests": [{"prompt": PROMPT, "max_new": NEW}]}
    steps, capacity = golden_steps()
    cases["golden"] = {"dir": str(GOLDEN), "steps": steps, "capacity": capacity}
    return run_job({"kind": "cases", "cases": cases}, tmp_path_factory.mktemp("tp"))


@pytest.mark.parametrize("name", MODELS)
def test_greedy_ids_equal_hf(ranks, hf, name):
    assert ranks[0][name]["tokens"][0] == hf[name][1]


def test_greedy_ids_from_gguf_equal_the_refimpl(ranks, gguf_model):
    """Each rank dequantizes tensor by tensor, puts q/k rows back in HF's order and keeps its slice."""
    assert ranks[0]["gguf"]["tokens"][0] == gguf_model[1]
    assert ranks[0]["gguf"]["shapes"]["qkv"] == [(2 + 2 * 1) * 16, 64]  # 4 heads, 2 KV heads of 16, split in 2


@pytest.mark.parametrize("name", MODELS)
def test_sampled_ids_equal_one_process(ranks, hf, name):
    ckpt = load_checkpoint(hf[name][0], with_tokenizer=False)
    one = AccelEngine.from_checkpoint(ckpt, device="cpu", dtype="fp32", use_triton=False)
    assert ranks[0][name]["tokens"][1] == list(one.generate(PROMPT, SAMPLED))


@pytest.mark.parametrize("name", MODELS)
def test_every_rank_decodes_the_same_tokens(ranks, name):
    """Rank 1 feeds its forward the tokens rank 0 sampled: every token, then the stop."""
    for tokens, follow in zip(ranks[0][name]["tokens"], [ranks[1][name]["followed"][:NEW],
                                                        ranks[1][name]["followed"][NEW:]]):
        assert [t for t, _ in follow] == tokens
        assert [go for _, go in follow] == [1] * (NEW - 1) + [0]


@pytest.mark.parametrize("name", MODELS)
def test_every_rank_allocates_its_session_at_the_same_message(ranks, name):
    """On the GPU allocating a session captures the decode step, whose warm-up runs its all-reduces: a rank that
    allocated after reading the prompt while rank 0 allocated before sending it hung (their collectives crossed)."""
    assert "alloc" in " ".join(ranks[0][name]["order"])
    assert ranks[1][name]["order"] == ranks[0][name]["order"]


@pytest.mark.parametrize("name", MODELS)
def test_each_rank_holds_its_slices_only(ranks, name):
    H, K, V, tied = MODELS[name]
    D, F, E = 48, 64, 12
    for rank in ranks:
        got = rank[name]
        local_kv = max(K // 2, 1)
        assert got["shapes"] == {"embed": [-(-V // 2), D], "lm_head": [-(-V // 2), D], "tied": tied,
                                 "qkv": [(H // 2 + 2 * local_kv) * E, D], "o": [D, H // 2 * E],
                                 "gate_up": [F, D], "down": [D, F // 2]}
        assert got["whole"] and all(n.endswith("norm.weight") for n in got["whole"]), got["whole"]


def test_golden_logits_at_tp2(ranks):
    """golden/toy-gqa's recorded logits (refimpl, fp32) for the prompt's last token and each decode step."""
    acts = SafetensorsFile(GOLDEN / "golden.safetensors")
    steps, _ = golden_steps()
    for step, got0, got1 in zip(steps, ranks[0]["golden"]["logits"], ranks[1]["golden"]["logits"]):
        ref = acts.load(f"{step['name']}/logits")[-1]
        c = compare(f"{step['name']}/logits", np.array(got0), ref, TOLERANCES["fp32"])
        assert c.ok, f"{step['name']}: max_abs {c.max_abs:.3g} nmse {c.nmse:.3g} at {c.worst} {c.problem}"
        assert got0 == got1  # the gathered logits are the same on both ranks


def test_fused_decode_step_equals_the_eager_forward(ranks):
    """A decoded token runs accel.model.decode_step over the shard (rank 0 adding its o/down partial sums into the
    residual stream, rank 1 overwriting it with its own, one all-reduce each): the eager forward's logits."""
    steps, _ = golden_steps()
    fused = [got for step, got in zip(steps, ranks[0]["golden"]["logits"]) if len(step["ids"]) == 1]
    assert len(fused) == len(ranks[0]["golden"]["eager"]) >= 2
    for i, (got, eager) in enumerate(zip(fused, ranks[0]["golden"]["eager"])):
        c = compare(f"decode step {i}", np.array(got), np.array(eager), TOLERANCES["fp32"])
        assert c.ok, f"decode step {i}: max_abs {c.max_abs:.3g} nmse {c.nmse:.3g} at {c.worst} {c.problem}"


def cli(*args, launcher=(sys.executable, "-m")) -> dict:
    """`llama32 ARGS --json` in a fresh process -> its record (rank 0 alone writes stdout: one JSON line)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([*launcher, "tools.cli", *args], capture_output=True, text=True, env=env, timeout=300,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_cli_tp2_greedy_equals_tp1_on_golden():
    """Started by llama32 itself, and under torchrun (every rank runs the command; rank 0 answers)."""
    common = ["generate", "Write one line about the sea, its tides and the moon.", "--model", str(GOLDEN),
              "--device", "cpu", "--max-new-tokens", "10", "--json"]
    tp1 = cli(*common, "--backend", "accel")
    torchrun = (sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                "127.0.0.1", "--master-port", str(free_port()), "-m")
    for tp2 in (cli(*common, "--tp", "2"), cli(*common, "--tp", "2", launcher=torchrun)):
        assert tp2["prompt_ids"] == tp1["prompt_ids"]
        assert tp2["generated_ids"] == tp1["generated_ids"] and len(tp1["generated_ids"]) == 10


def test_cli_chat_tp2_equals_tp1(tmp_path):
    """Turns continue in the ranks' kept caches (only the new turn prefilled); /reset rewinds them."""
    spec = ToySpec("toy-chat", dataclasses.replace(TOYS[0].config, tie_word_embeddings=False), seed=4)
    model = write_toy_checkpoint(spec, tmp_path)
    stdin = "the sea\nand the moon?\n/reset\nthe sea\ntides and the sun\n"

    def chat(*extra):
        done = subprocess.run([sys.executable, "-m", "tools.cli", "chat", "--model", str(model), "--device", "cpu",
                               "--max-new-tokens", "8", *extra], input=stdin, capture_output=True, text=True,
                              timeout=300, cwd=ROOT, env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
        assert done.returncode == 0, done.stderr
        return done.stdout
    tp2, tp1 = chat("--tp", "2"), chat("--backend", "accel")
    assert tp2 == tp1
    answers = [a for a in tp1.split("> ")[1:] if not a.startswith("/")]
    assert len(answers) == 4 and len(set(answers[1:])) == 3  # the toy answers each turn differently


def test_kv_heads_neither_split_nor_replicated_is_refused(tmp_path):
    cfg = LlamaConfig(vocab_size=32, hidden_size=48, intermediate_size=96, num_hidden_layers=1,
                      num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=64)
    with pytest.raises(ConfigError, match=r"--tp 2 and the model's 3 KV heads"):
        check_divisible(cfg, 2)
    check_divisible(cfg, 3)  # 3 divides 3: split
    check_divisible(cfg, 6)  # 6 is a multiple of 3: replicated
    save_checkpoint(tmp_path, cfg, random_params(cfg))
    r = CliRunner().invoke(main, ["generate", "hi", "--model", str(tmp_path), "--tp", "2", "--device", "cpu"])
    assert r.exit_code == 2
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --tp 2 and the model's 3 KV heads"), r.output


@pytest.mark.parametrize("args, says", [
    (["--quant", "gguf"], "--quant gguf with --tp: each rank quantizes its own slices"),
    (["--backend", "refimpl"], "--tp 2 runs on the accel backend"),
])
def test_generate_tp_refuses_what_it_does_not_run(args, says):
    r = CliRunner().invoke(main, ["generate", "hi", "--model", str(GOLDEN), "--tp", "2", *args])
    assert r.exit_code == 2 and r.output.startswith(f"error: {says}"), r.output
    assert len(r.output.strip().splitlines()) == 1


def test_a_rank_that_fails_to_load_stops_every_rank(tmp_path):
    rank0, rank1 = run_job({"kind": "fail", "case": {"dir": str(GOLDEN), "rank": 1}}, tmp_path, timeout=120)
    assert rank1 == {"raised": "CheckpointError", "message": "a broken shard"}
    assert rank0["raised"] == "RankFailed" and rank0["message"].startswith("rank 1 of --tp 2 failed to load")


def test_a_rank_loads_its_shard_without_the_whole_model(tmp_path):
    """Host memory: each rank's high-water mark rises by its half of the model and one slice, well under the
    whole model (~148 MiB fp32 here; measured: ~82 MiB a rank, docs/performance.md)."""
    cfg = LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=2048, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False)
    params = {name: np.full(shape, 0.01, np.float32) for name, shape in expected_shapes(cfg).items()}
    model_bytes = sum(a.nbytes for a in params.values())
    save_checkpoint(tmp_path / "model", cfg, params)
    del params
    for r, rank in enumerate(run_job({"kind": "peak", "case": {"dir": str(tmp_path / "model")}}, tmp_path)):
        rise = (rank["peak_kib"] - rank["before_kib"]) * 1024
        assert rank["shard_bytes"] == 4 * shard_elements(ShardPlan(cfg, r, 2))  # what the GPU check counts
        assert rank["shard_bytes"] < 0.51 * model_bytes
        assert rank["shard_bytes"] <= rise < 0.75 * model_bytes, (rise / 2**20, model_bytes / 2**20)


def _diff(*args):
    return CliRunner().invoke(main, ["diff", "the toy", "--steps", "2", "--device", "cpu", *args])


@pytest.mark.parametrize("toy", ["toy-gqa", "toy-mqa"])  # KV heads split over the ranks / replicated on both
def test_diff_tp2_compares_every_activation(toy):
    """`diff --tp 2`: every activation of the split forward, gathered whole, against --tp 1 (--a accel) and against
    the oracle (refimpl), on the same names the one-process diff compares."""
    model = str(ROOT / "golden" / toy)
    whole = _diff("--model", model, "--a", "accel")
    assert whole.exit_code == 0, whole.output
    checked = whole.output.strip().splitlines()[-1]
    assert checked.startswith("all ") and checked.endswith("activations within fp32 tolerance"), checked
    for reference in ("accel", "refimpl"):
        r = _diff("--model", model, "--a", reference, "--tp", "2", "-v")
        assert r.exit_code == 0, r.output
        assert f"a={reference} vs b=accel (fp32, b over --tp 2)" in r.output
        assert r.output.strip().splitlines()[-1] == checked  # the same activations, each within tolerance
        assert "decode1/layers.0.attn.k_rot" in r.output and "prefill/logits" in r.output


@pytest.mark.parametrize("args, expected", [
    (["--model", str(GOLDEN), "--isolate"], "error: --tp 2 does not take --isolate"),
    (["--model", str(GOLDEN), "--b", "refimpl"], "error: --tp 2 splits the accel backend: give --b accel"),
    (["--model", str(ROOT / "golden" / "toy-vision")], "error: --tp 2: llama32 diff splits Llama 3.2 text models;"),
])
def test_diff_tp_refusals(args, expected):
    r = _diff(*args, "--tp", "2")
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1, r.output
    assert r.output.startswith(expected), r.output


def test_golden_check_tp2_compares_each_steps_logits(tmp_path):
    """`golden check --tp 2` passes on golden/toy-gqa and fails on a copy whose last step's logits are off by 1%
    (exit 1, the failing row named); the vision record is skipped; what it cannot check is refused."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}

    def check(golden):
        return subprocess.run([sys.executable, "-m", "tools.cli", "golden", "check", "--tp", "2", "--device", "cpu",
                               "--golden", str(golden)], capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    ok = check(GOLDEN)
    assert ok.returncode == 0, ok.stderr
    assert [line.split()[0] for line in ok.stdout.splitlines() if "/logits" in line] == [
        "prefill/logits", "decode0/logits", "decode1/logits"] and ok.stdout.count(" ok") == 3
    bad_dir = tmp_path / "toy-gqa"
    shutil.copytree(GOLDEN, bad_dir)
    acts = SafetensorsFile(bad_dir / "golden.safetensors")
    tensors = {name: acts.load(name) for name in acts.tensors}
    tensors["decode1/logits"] = tensors["decode1/logits"] * np.float32(1.01)
    save_safetensors(bad_dir / "golden.safetensors", tensors)
    bad = check(bad_dir)
    assert bad.returncode == 1, bad.stderr
    assert "decode1/logits" in bad.stdout and "FAIL" in bad.stdout.split("decode1/logits")[1].splitlines()[0]
    r = CliRunner().invoke(main, ["golden", "check", "--tp", "2", "--filter", "*.attn.*"])
    assert r.exit_code == 2 and r.output.strip() == ("error: --tp 2 checks each step's logits on the accel backend (a "
                                                     "rank holds slices of the other activations); drop --filter")
