"""The batched engine over a tensor-parallel group on the CPU (gloo, 2 ranks): `llama32 batch --tp 2` gives the
records of `--tp 1` and HF transformers' greedy ids on a tiny random GQA model (untied, the toy tokenizer's
vocabulary) with prompts of 3 to 101 tokens, chunked prefill beside decode rows and a pool small enough that
requests wait for blocks; started by llama32 and under torchrun; the engine itself on an MQA model with an odd
vocabulary against the one-process engine's logits; the step message; the refusals; and `llama32 serve --tp 2`
through the openai client."""
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from transformers import LlamaConfig as HFConfig, LlamaForCausalLM

from accel.tp.batch import pack, unpack
from accel.tp.group import free_port
from refimpl.compare import TOLERANCES, compare
from refimpl.formats.checkpoint import load_checkpoint
from tests._tp_batch_harness import run_job
from tools.batch_requests import read_requests
from tools.cli import main
from tools.toy import TOYS, VOCAB_SIZE, write_toy_checkpoint

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "golden" / "toy-gqa"
WORDS = ("the tides and the moon turn over the sea while a gull waits on the harbour wall for the boats to come "
         "home with their nets full of silver fish and salt").split()
NEW = 8


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A random HF Llama (4 heads, 2 KV heads, untied) with the toy tokenizer (vocabulary 288) beside it."""
    toy = write_toy_checkpoint(TOYS[0], tmp_path_factory.mktemp("toy"))
    cfg = HFConfig(vocab_size=VOCAB_SIZE, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                   tie_word_embeddings=False, initializer_range=0.2, bos_token_id=TOYS[0].config.bos_token_id,
                   eos_token_id=list(TOYS[0].config.eos_token_ids), pad_token_id=0)
    torch.manual_seed(7)
    hf = LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("model")
    hf.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(toy / name, path / name)
    return path, hf


@pytest.fixture(scope="module")
def adapters(model, tmp_path_factory):
    """Two PEFT LoRA adapters: one on q, v and o (o row-parallel), one on k and the MLP (down row-parallel)."""
    from tests._peft_adapters import make_adapters
    return make_adapters(model[0], tmp_path_factory.mktemp("adapters"), {
        "a": ["q_proj", "v_proj", "o_proj"], "b": ["k_proj", "gate_proj", "up_proj", "down_proj"]})


@pytest.fixture(scope="module")
def requests_file(tmp_path_factory):
    """Prompts of 3 to 101 tokens (the byte-level toy tokenizer: about one token a character or two); r3's and r5's
    prompts again under each adapter."""
    lengths = [1, 30, 2, 12, 5, 24, 3]
    path = tmp_path_factory.mktemp("in") / "in.jsonl"
    lines = [{"id": f"r{i}", "prompt": " ".join(WORDS[:n]), "max_tokens": NEW} for i, n in enumerate(lengths)]
    lines.append({"id": "sampled", "prompt": " ".join(WORDS[:9]), "max_tokens": NEW, "temperature": 0.9,
                  "seed": 11})
    lines += [{"id": f"{a}{i}", "prompt": " ".join(WORDS[:lengths[i]]), "max_tokens": NEW, "adapter": a}
              for a in "ab" for i in (3, 5)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def batch_cli(model_dir, inp, out, *extra, launcher=(sys.executable, "-m")) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([*launcher, "tools.cli", "batch", "--model", str(model_dir), "--input", str(inp),
                           "--output", str(out), "--device", "cpu", "--max-num-batched-tokens", "24",
                           "--max-num-seqs", "4", *extra], capture_output=True, text=True, env=env, timeout=300,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in Path(out).read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(model, adapters, requests_file, tmp_path_factory):
    """The records of --tp 1, --tp 2 started by llama32 with a pool of 8 blocks of 16 tokens a rank (the longest
    request needs 7: requests wait for blocks, some are preempted and recomputed, and the prompts' shared first
    words are prefix-cached, as the engine's stats showed when this test was written), and --tp 2 under torchrun;
    each with both adapters."""
    out = tmp_path_factory.mktemp("out")
    lora = [arg for name, path in adapters.items() for arg in ("--lora", f"{name}={path}")]
    torchrun = (sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                "127.0.0.1", "--master-port", str(free_port()), "-m")
    per_block = 2 * 2 * 1 * 16 * 12 * 4  # K and V, 2 layers, 1 KV head a rank, 16 tokens, head_dim 12, fp32
    return {"tp1": batch_cli(model[0], requests_file, out / "tp1.jsonl", "--backend", "accel", *lora),
            "tp2": batch_cli(model[0], requests_file, out / "tp2.jsonl", "--tp", "2", "--gpu-memory",
                             str(9 * per_block), *lora),
            "torchrun": batch_cli(model[0], requests_file, out / "torchrun.jsonl", "--tp", "2", *lora,
                                  launcher=torchrun)}


def hf_greedy(hf, prompt: list[int], stop_ids) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                          eos_token_id=list(stop_ids), pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_tp2_records_equal_tp1(runs):
    """Adapters included: each rank applies its part of every adapter (lora_B's rows of q, k, v, gate and up,
    lora_A's columns of o and down)."""
    assert [r["id"] for r in runs["tp1"]] == [f"r{i}" for i in range(7)] + ["sampled", "a3", "a5", "b3", "b5"]
    assert runs["tp2"] == runs["tp1"]
    assert runs["torchrun"] == runs["tp1"]
    ids = {r["id"]: r["generated_ids"] for r in runs["tp2"]}
    for i in (3, 5):  # the adapters change the answers
        assert len({tuple(ids[f"r{i}"]), tuple(ids[f"a{i}"]), tuple(ids[f"b{i}"])}) == 3


def test_tp2_greedy_ids_equal_hf(runs, model, requests_file):
    ckpt = load_checkpoint(model[0], with_tokenizer=True)
    requests = read_requests(requests_file, ckpt.tokenizer, 256, NEW, adapters=("a", "b"))
    got = {r["id"]: r["generated_ids"] for r in runs["tp2"]}
    lengths = set()
    for req in requests:
        if req.id == "sampled" or req.adapter is not None:
            continue
        lengths.add(len(req.prompt_ids))
        assert got[req.id] == hf_greedy(model[1], req.prompt_ids, ckpt.stop_ids), req.id
    assert min(lengths) < 8 and max(lengths) > 100, lengths  # mixed: several prefill chunks for the longest


def test_step_message_round_trip():
    """What the followers run is what rank 0 ran: every field of a mixed step through pack/unpack."""
    from accel.batch.runner import StepInputs
    inp = StepInputs(ids=torch.tensor([5, 6, 7, 8, 9]), positions=torch.tensor([3, 9, 0, 1, 2]),
                     slots=torch.tensor([35, 57, 64, 65, 66]), num_decode=2,
                     tables=torch.tensor([[2, 0], [1, 3]], dtype=torch.int32),
                     lens=torch.tensor([4, 10], dtype=torch.int32),
                     prefills=[(2, 3, torch.tensor([64, 65, 66]))], sample_rows=torch.tensor([0, 1, 4]),
                     sampled=[], graph_key=None, lora_tiles=torch.tensor([[0, 2, 1], [2, 5, 0]], dtype=torch.int32),
                     feed=torch.tensor([[0, 1], [1, 0]]))
    header, payload = pack(inp, prev=torch.tensor([41, 42, 43]))
    assert header[-2] == 3  # the previous step's tokens follow: rows 0 and 1 take theirs from them
    got = unpack(header, payload)
    for name in ("ids", "positions", "slots", "tables", "lens", "sample_rows", "lora_tiles", "feed"):
        assert torch.equal(getattr(got, name), getattr(inp, name)), name
        assert getattr(got, name).dtype == getattr(inp, name).dtype, name
    assert got.num_decode == 2 and got.graph_key is None and len(got.prefills) == 1
    assert got.prefills[0][:2] == (2, 3) and torch.equal(got.prefills[0][2], inp.prefills[0][2])
    inp.graph_key, inp.prefills, inp.lora_tiles, inp.feed = (4, 64), [], None, None
    got = unpack(*pack(inp))
    assert got.graph_key == (4, 64) and got.lora_tiles is None and got.feed is None


@pytest.mark.parametrize("flags, says", [
    (["--batch-invariant"], "--tp 2 does not take --batch-invariant"),
    (["--eval"], "--tp 2 does not take --eval"),
    (["--backend", "refimpl"], "--tp 2 runs on the accel backend"),
    (["--tp", "3"], "--tp 3 does not divide the model's 4 attention heads"),
])
def test_batch_tp_refuses_what_it_does_not_run(flags, says, model, requests_file, tmp_path):
    r = CliRunner().invoke(main, ["batch", "--model", str(model[0]), "--input", str(requests_file), "--output",
                                  str(tmp_path / "out.jsonl"), "--tp", "2", "--device", "cpu", *flags])
    assert r.exit_code == 2 and r.output.startswith(f"error: {says}"), r.output
    assert len(r.output.strip().splitlines()) == 1
    assert not (tmp_path / "out.jsonl").exists()


def generate_json(prompt: str, chat: bool, new: int) -> dict:
    """The oracle: `llama32 generate --json` on the refimpl backend (one process, NumPy)."""
    r = CliRunner().invoke(main, ["generate", "--model", str(GOLDEN), "--backend", "refimpl", "--max-new-tokens",
                                  str(new), "--json", "--chat" if chat else "--no-chat", prompt])
    assert r.exit_code == 0, r.output
    return json.loads(r.output.strip().splitlines()[-1])


def test_serve_tp2_answers_as_generate_and_stops_on_ctrl_c():
    """`llama32 serve --tp 2` (rank 0 serves HTTP, rank 1 follows its steps) through the official openai client:
    greedy chat and completion answers equal `llama32 generate --json`'s; Ctrl-C stops every rank cleanly."""
    pytest.importorskip("fastapi")
    from openai import OpenAI
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "LLAMA32_API_KEY": ""}
    proc = subprocess.Popen([sys.executable, "-m", "tools.cli", "serve", "--model", str(GOLDEN), "--device", "cpu",
                             "--tp", "2", "--port", str(port)], cwd=ROOT, env=env, stderr=subprocess.PIPE,
                            text=True)
    try:
        line = proc.stderr.readline()
        assert f"at http://127.0.0.1:{port}/" in line, line + proc.stderr.read() if proc.poll() is not None else line
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=3, timeout=120)
        want = generate_json("the cat sat", chat=True, new=12)
        got = client.chat.completions.create(model="toy-gqa", max_tokens=12, temperature=0,
                                             messages=[{"role": "user", "content": "the cat sat"}])
        assert got.choices[0].message.content == want["text"]
        assert got.usage.completion_tokens == len(want["generated_ids"])
        want = generate_json("and the sea", chat=False, new=10)
        got = client.completions.create(model="toy-gqa", prompt="and the sea", max_tokens=10, temperature=0, n=2)
        assert [c.text for c in got.choices] == [want["text"]] * 2
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_engine_tp2_mqa_odd_vocab_logits_equal_one_process(tmp_path):
    """The engine itself over 2 ranks on an MQA model (its one KV head replicated on both ranks, each rank's pool
    holding it) with a tied embedding of a vocabulary 2 does not divide (the last rank's rows padded): every step's
    logits within fp32 tolerance of the one-process engine's, and the same greedy ids."""
    cfg = HFConfig(vocab_size=67, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=1, max_position_embeddings=128, tie_word_embeddings=True,
                   initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(3)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "model")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 67, n).tolist() for n in (4, 40, 1, 17)]
    got = run_job({"device": "cpu", "dir": str(tmp_path / "model"), "dtype": "fp32", "prompts": prompts,
                   "max_tokens": 6, "return_logits": True,
                   "options": {"max_num_batched_tokens": 16, "num_blocks": 12, "block_size": 4,
                               "overlap": True}}, tmp_path)
    assert got["tokens"] == got["ref_tokens"]
    for i, (rows, ref_rows) in enumerate(zip(got["logits"], got["ref_logits"])):
        assert len(rows) == len(ref_rows) == 6
        for step, (a, b) in enumerate(zip(rows, ref_rows)):
            c = compare(f"request {i} step {step}", np.array(a), np.array(b), TOLERANCES["fp32"])
            assert c.ok, f"{c.name}: max_abs {c.max_abs:.3g} nmse {c.nmse:.3g} {c.problem}"
