"""Tensor parallelism on 2 GPUs over NCCL (needs 2 CUDA GPUs): TP=2 logits within bf16 tolerance of the one-GPU
engine's on random weights at Llama 3.2 1B's layer shapes (2 layers; the decoded tokens through the fused decode
step captured in a CUDA graph with its all-reduces, and through the eager forward), golden/toy-gqa's recorded
logits at --tp 2, and `llama32 generate --tp 2` giving `--tp 1`'s greedy ids in fp32."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from refimpl.compare import TOLERANCES, compare
from refimpl.formats.checkpoint import load_checkpoint, save_checkpoint
from refimpl.formats.params import random_params
from refimpl.formats.safetensors_io import SafetensorsFile
from refimpl.model.config import LlamaConfig
from tests._tp_harness import run_job

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                reason="needs CUDA: 2 GPUs")

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "golden" / "toy-gqa"
PROMPT = [128000, 791, 3363, 315, 9822, 374, 12366, 13, 578, 6864, 315, 9635, 374]


def assert_close(name, got, ref, tol):
    c = compare(name, np.asarray(got), np.asarray(ref), tol)
    assert c.ok, f"{name}: max_abs {c.max_abs:.3g} (ref max {c.ref_max:.3g}) nmse {c.nmse:.3g} at {c.worst}"


@pytest.fixture(scope="module")
def one_b_layers(tmp_path_factory):
    """Random bf16 weights at Llama 3.2 1B's shapes (vocabulary, heads, KV heads, MLP), 2 layers."""
    cfg = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=2,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=256)
    return save_checkpoint(tmp_path_factory.mktemp("1b2"), cfg, random_params(cfg, seed=1), dtype="BF16")


def check_against_one_gpu(model_dir, tmp_path, **case):
    """TP=2's logits for a prompt and two decoded tokens (the captured fused step, and the eager forward after it)
    against one GPU's."""
    from accel.engine import AccelEngine
    steps = [{"ids": PROMPT, "start": 0}] + [{"ids": [t], "start": len(PROMPT) + i} for i, t in enumerate([11, 279])]
    ranks = run_job({"kind": "cases", "device": "cuda", "cases": {"m": {
        "dir": str(model_dir), "dtype": "bf16", "steps": steps, "capacity": len(PROMPT) + 2, **case}}}, tmp_path)
    engine = AccelEngine.from_checkpoint(load_checkpoint(model_dir, with_tokenizer=False), device="cuda:0",
                                         dtype="bf16")
    sess = engine.session(len(PROMPT) + 2)
    for i, step in enumerate(steps):
        ref = engine.prefill(step["ids"], sess, step["start"])[0].float().cpu().numpy()
        assert_close(f"step {i} logits", ranks[0]["m"]["logits"][i], ref, TOLERANCES["bf16"])
        assert ranks[0]["m"]["logits"][i] == ranks[1]["m"]["logits"][i]
    for i, (fused, eager) in enumerate(zip(ranks[0]["m"]["logits"][1:], ranks[0]["m"]["eager"])):
        assert_close(f"decode step {i}: the captured fused step against the eager forward", fused, eager,
                     TOLERANCES["bf16"])


def test_tp2_logits_within_bf16_of_one_gpu(one_b_layers, tmp_path):
    check_against_one_gpu(one_b_layers, tmp_path)


def test_golden_logits_at_tp2_bf16(tmp_path):
    manifest = json.loads((GOLDEN / "golden.json").read_text())
    steps = [{"name": s["name"], "ids": s["ids"], "start": s["positions"][0]} for s in manifest["steps"]]
    ranks = run_job({"kind": "cases", "device": "cuda", "cases": {"golden": {
        "dir": str(GOLDEN), "dtype": "bf16", "steps": steps, "capacity": steps[-1]["start"] + 1}}}, tmp_path)
    acts = SafetensorsFile(GOLDEN / "golden.safetensors")
    for step, got in zip(steps, ranks[0]["golden"]["logits"]):
        assert_close(step["name"], got, acts.load(f"{step['name']}/logits")[-1], TOLERANCES["bf16"])


def test_cli_tp2_greedy_equals_tp1_fp32():
    def ids(*extra):
        done = subprocess.run([sys.executable, "-m", "tools.cli", "generate", "Write one line about the sea.",
                               "--model", str(GOLDEN), "--dtype", "fp32", "--max-new-tokens", "10", "--json",
                               *extra], capture_output=True, text=True, timeout=300, cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)["generated_ids"]
    assert ids("--tp", "2") == ids("--backend", "accel")



def test_cli_diff_tp2_bf16_against_the_oracle():
    """`llama32 diff --tp 2` on 2 GPUs: every activation of the split forward (gathered whole) within bf16 tolerance
    of the refimpl's, a prompt and two decode steps."""
    done = subprocess.run([sys.executable, "-m", "tools.cli", "diff", "Write one line about the sea.", "--model",
                           str(GOLDEN), "--dtype", "bf16", "--steps", "2", "--tp", "2"], capture_output=True,
                          text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
    assert done.returncode == 0, done.stdout + done.stderr
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("all ") and last.endswith("activations within bf16 tolerance"), last
