"""tools/bench/hf_attention.py on a machine without CUDA: its arguments are checked, it refuses with one error line
(exit 2) instead of a traceback, its model shapes are Llama 3.2's (parameter counts on the meta device), and its
ratio column compares each row with the unpatched sdpa row of the same model and kind."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tools.bench import common, hf_attention
from tools.debug import memory_trace

ROOT = Path(__file__).resolve().parents[1]


def run_script(*args):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, "-m", "tools.bench.hf_attention", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is what a machine without CUDA sees")
def test_refuses_without_cuda_in_one_line():
    out = run_script("--models", "1b", "--kinds", "prefill")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip().splitlines() == [
        "error: python3 -m tools.bench.hf_attention needs a CUDA GPU (torch.cuda.is_available() is False here)"]


@pytest.mark.parametrize("args, message", [
    (["--models", "1b,7b"], "error: --models: 7b not one of 1b, 3b, 11b-vision"),
    (["--kinds", "train,decode"], "error: --kinds: expected some of train, prefill, image, memory, got train,decode"),
    (["--impls", "llama32"], "error: --impls: sdpa must be among them"),
    (["--tokens", "0"], "error: --tokens: expected a positive integer, got 0"),
    (["--patches", "kernels"], "error: --patches: expected none (every row is compared with it)"),
    (["--patches", "none,liger"], "error: --patches: expected none (every row is compared with it)"),
    (["--rows", "llama32:kernels+lora"], "error: --rows: expected impl:patch pairs, sdpa:none among them"),
    (["--rows", "sdpa:none,llama32"], "error: --rows: expected impl:patch pairs, sdpa:none among them"),
    (["--rows", "sdpa:none,llama32:liger"], "error: --rows: expected impl:patch pairs, sdpa:none among them"),
])
def test_bad_arguments_are_one_line_errors(args, message, capsys):
    with pytest.raises(SystemExit) as e:
        hf_attention.parse_args(args)
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().startswith(message)


def test_defaults():
    args = hf_attention.parse_args([])
    assert args.models == ["1b", "3b", "11b-vision"] and args.tokens == 2048 and args.prefill_tokens == 8192
    assert args.impls == ["sdpa", "llama32", "flash_attention_2"] and args.kinds == ["train", "prefill", "image"]
    assert args.patches == ["", "kernels", "kernels+lora"]
    assert hf_attention.configurations(["sdpa", "llama32"], args.patches, "prefill") == [
        ("sdpa", ""), ("llama32", ""), ("sdpa", "kernels"), ("llama32", "kernels")]  # LoRA rows: training only
    assert len(hf_attention.configurations(["sdpa", "llama32"], args.patches, "train")) == 6


@pytest.mark.parametrize("name, billions", [("1b", 1.236), ("3b", 3.213), ("11b-vision", 10.67)])
def test_model_shapes_are_llama_3_2s(name, billions):
    model = common.hf_random_model(name, None, device="meta")
    n = sum(p.numel() for p in model.parameters())
    assert abs(n / 1e9 - billions) < 0.01, n
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_ratios_are_against_the_unpatched_sdpa_row():
    rows = [dict(model="1b", kind="train", attention="sdpa", patch="", ms=10.0, peak_gib=4.0),
            dict(model="1b", kind="train", attention="llama32", patch="kernels", ms=8.0, peak_gib=3.0),
            dict(model="1b", kind="prefill", attention="llama32", patch="", ms=1.0, peak_gib=1.0),
            dict(model="1b", kind="train", attention="flash_attention_2", patch="", error="ImportError: x")]
    hf_attention.add_ratios(rows)
    assert rows[0]["vs_sdpa"] == 1.0 and rows[1]["vs_sdpa"] == 1.25 and rows[1]["mem_vs_sdpa"] == 0.75
    assert "vs_sdpa" not in rows[2] and "vs_sdpa" not in rows[3]  # no sdpa prefill row; an error row
    assert "error: ImportError" in hf_attention.format_row(rows[3])
    assert "1.25x" in hf_attention.format_row(rows[1])


def test_paired_ratio_is_the_median_of_per_round_ratios():
    """A drift shared by a round's rows cancels in the paired ratio: sdpa's steps 10, 20, 40 ms against 5, 10, 40."""
    rows = [dict(model="3b", kind="train", attention="sdpa", patch="", ms=20.0, peak_gib=4.0, steps_ms=[10, 20, 40]),
            dict(model="3b", kind="train", attention="llama32", patch="", ms=10.0, peak_gib=4.0, steps_ms=[5, 10, 40])]
    hf_attention.add_ratios(rows)
    assert rows[1]["paired_vs_sdpa"] == 2.0 and rows[0]["paired_vs_sdpa"] == 1.0
    assert "paired 2.00x" in hf_attention.format_row(rows[1])


class _FakeEvent:
    clock = [0.0]

    def __init__(self, enable_timing=False):
        self.t = None

    def record(self):
        _FakeEvent.clock[0] += 1.0
        self.t = _FakeEvent.clock[0]

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return other.t - self.t


def test_training_rows_run_round_robin_and_an_error_leaves_the_rounds(monkeypatch):
    """The round-robin loop on CPU (torch.cuda's timing and memory calls stubbed): one row per configuration in
    order, `steps` timed steps each after the warm-up rounds, the steps interleaved across rows, and a configuration
    that raises becomes its row's error without stopping the others."""
    peft = pytest.importorskip("peft")
    from tests._hf_tiny import llama
    for name, value in (("synchronize", lambda: None), ("reset_peak_memory_stats", lambda: None),
                        ("max_memory_allocated", lambda: 2**30), ("empty_cache", lambda: None),
                        ("Event", _FakeEvent)):
        monkeypatch.setattr(torch.cuda, name, value)
    order = []
    real_switch = hf_attention.switch

    def switch(model, impl, patch):
        order.append((impl, patch))
        if impl == "broken":
            raise RuntimeError("no such implementation")
        real_switch(model, impl, patch)
    monkeypatch.setattr(hf_attention, "switch", switch)
    model = llama()
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    inputs = dict(input_ids=torch.randint(3, 64, (1, 8)))
    rows = []
    configs = [("sdpa", ""), ("broken", ""), ("sdpa", "kernels+lora")]
    hf_attention.train_rows(rows, "tiny", model, lora, inputs, configs, steps=2, tokens=8)
    assert [(r["attention"], r["patch"]) for r in rows] == configs
    assert "error: RuntimeError: no such implementation" in hf_attention.format_row(rows[1])
    assert len(rows[0]["steps_ms"]) == len(rows[2]["steps_ms"]) == 2 and rows[0]["peak_gib"] == 1.0
    rounds = hf_attention.WARMUP_ROUNDS + 2
    assert order == [configs[0], configs[1], configs[2]] + [configs[0], configs[2]] * (rounds - 1)
    import accel.hf
    accel.hf.revert(model)  # RoPE is patched process-wide: leave HF's behind


def test_peak_allocations_replays_the_allocators_trace():
    """A trace by hand: 1000 bytes allocated before recording, of which a 300-byte block is freed; the step's own
    allocations peak at 1000 - 300 + 100 + 200 + 400 = 1400 bytes, when its 50-byte block is already freed."""
    f = lambda path, line, name: {"filename": path, "line": line, "name": name}  # noqa: E731
    mlp = [f("/x/torch/autograd/function.py", 1, "apply"), f("/r/accel/hf/mlp.py", 40, "backward"),
           f("/x/torch/utils/checkpoint.py", 9, "unpack")]
    loss = [f("/r/accel/train/loss.py", 30, "forward"), f("/r/accel/hf/patch.py", 5, "fused_loss_forward")]
    trace = [dict(action="alloc", addr=1, size=100, frames=mlp),
             dict(action="free_completed", addr=9, size=300, frames=[]),
             dict(action="alloc", addr=2, size=50, frames=loss),
             dict(action="alloc", addr=3, size=200, frames=mlp),
             dict(action="free_completed", addr=2, size=50, frames=[]),
             dict(action="alloc", addr=4, size=400, frames=[]),
             dict(action="free_completed", addr=4, size=400, frames=[]),
             dict(action="alloc", addr=5, size=100, frames=loss)]
    found = memory_trace.peak_allocations(trace, 1000)
    assert found["peak_bytes"] == 1400 and found["before_bytes"] == 700
    assert found["groups"] == [["(no Python frame: the autograd engine's own ops)", 400, 1],
                               ["hf/mlp.py:40 backward < utils/checkpoint.py:9 unpack", 300, 2]]
    assert found["at_peak"] == "(no Python frame: the autograd engine's own ops)"


def test_rows_pick_configurations_and_offload_rows_show_their_host_memory():
    args = hf_attention.parse_args(["--rows", "sdpa:none,llama32:kernels+lora,llama32:kernels+lora+offload"])
    assert args.impls == ["sdpa", "llama32"] and args.patches == ["", "kernels+lora", "kernels+lora+offload"]
    want = [("sdpa", ""), ("llama32", "kernels+lora"), ("llama32", "kernels+lora+offload")]
    for kind in ("train", "memory"):
        assert hf_attention.configurations(args.impls, args.patches, kind, args.rows) == want
    assert hf_attention.configurations(args.impls, args.patches, "prefill", args.rows) == [("sdpa", "")]
    row = dict(model="3b", kind="train", attention="llama32", patch="kernels+lora+offload", ms=5.0, tokens_per_s=1.0,
               peak_gib=6.5, host_gib=0.328, pinned_gib=0.44)
    assert hf_attention.format_row(row).endswith("host 0.328 GiB (pinned allocator 0.44 GiB)")
    assert "host" not in hf_attention.format_row(dict(row, host_gib=0.0))
