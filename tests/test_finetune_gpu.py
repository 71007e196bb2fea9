"""The trainer on CUDA (Triton FlashAttention forward + backward in the loop) against HF + PEFT on the CPU.

head_dim 64 (hidden 256, 4 heads), the kernel's real tile. fp32 base: the step must match PEFT's within 1e-2 of the
step's own size (the attention kernel's dots may run in TF32 on the GPU). bf16 base: 30 AdamW steps halve the loss.
"""
import json

import pytest

from _badinput import run_cli
from test_finetune import CONVERSATIONS, TARGETS, finetune_args, hf_chat_model, sgd_step_errors, write_jsonl

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_one_sgd_step_on_cuda_equals_hf_peft(tmp_path):
    for key, (err, step, size) in sgd_step_errors(tmp_path, 2, TARGETS, hidden=256, device="cuda").items():
        assert step > 1e-3 * size, key
        assert err <= 1e-2 * step, (key, err, step)


def test_bf16_adamw_halves_loss_on_cuda(tmp_path):
    hf_chat_model(tmp_path / "base", hidden=256)
    data = write_jsonl(tmp_path / "train.jsonl", CONVERSATIONS[:3])
    result = run_cli(finetune_args(tmp_path / "base", data, tmp_path / "out", "--device", "cuda", "--dtype", "bf16",
                                   "--max-steps", 30, "--lr", "1e-2", "--batch-size", 3, "--json"))
    assert result.exit_code == 0, result.output
    steps = [json.loads(line) for line in result.stdout.splitlines() if '"step"' in line]
    assert len(steps) == 30 and steps[-1]["loss"] < 0.5 * steps[0]["loss"], (steps[0], steps[-1])
