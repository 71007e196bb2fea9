"""Unmerged LoRA at run time (the `lora_linear` op in both engines) and `llama32 lora merge`.

Oracles: PEFT's own LoRA Linear layer and PEFT-wrapped HF models built in the test (fp32); accel's op is checked
against the refimpl's. `lora merge` output is loaded by HF transformers and compared with PEFT's merge_and_unload.
"""
import json

import numpy as np
import pytest

from _badinput import assert_clean_error, generate_args, run_cli
from refimpl.formats.checkpoint import load_checkpoint
from refimpl.formats.lora import attach_lora, load_lora, merge_lora
from refimpl.model import ops
from refimpl.model.llama import LoraWeight
from test_lora import LORA_CASES, hf_base, peft_adapter, refimpl_logits

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


@pytest.mark.parametrize("T,d_in,d_out,r,scale", [(1, 7, 5, 1, 2.0), (13, 33, 17, 3, 0.7), (4, 64, 96, 16, 0.25)])
def test_lora_linear_matches_peft_layer(T, d_in, d_out, r, scale):
    torch.manual_seed(T)
    holder = torch.nn.Module()
    holder.lin = base = torch.nn.Linear(d_in, d_out, bias=False)
    wrapped = peft.get_peft_model(holder, peft.LoraConfig(r=r, lora_alpha=scale * r, target_modules=["lin"]))
    layer = wrapped.base_model.model.lin
    with torch.no_grad():
        layer.lora_B["default"].weight.normal_()
    x = torch.randn(T, d_in)
    with torch.no_grad():
        want = layer(x).numpy()
    got = ops.lora_linear(x.numpy(), base.weight.detach().numpy(), layer.lora_A["default"].weight.detach().numpy(),
                          layer.lora_B["default"].weight.detach().numpy(), scale)
    assert got.shape == want.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.abs(want - x.numpy() @ base.weight.detach().numpy().T).max() > 1e-2  # the LoRA term matters


@pytest.mark.parametrize("dtype,rtol,atol", [(torch.float32, 1e-5, 1e-5), (torch.bfloat16, 1.6e-2, 2e-2)])
@pytest.mark.parametrize("T,d_in,d_out,r", [(1, 9, 5, 2), (19, 40, 24, 8)])
def test_accel_lora_linear_matches_refimpl(T, d_in, d_out, r, dtype, rtol, atol):
    from accel.ops import lora_linear
    rng = np.random.default_rng(T + r)
    x, w = rng.standard_normal((T, d_in), np.float32), rng.standard_normal((d_out, d_in), np.float32) / 4
    a, b = rng.standard_normal((r, d_in), np.float32), rng.standard_normal((d_out, r), np.float32)
    x_t, w_t = torch.from_numpy(x).to(dtype), torch.from_numpy(w).to(dtype)
    got = lora_linear(x_t, w_t, torch.from_numpy(a), torch.from_numpy(b), 0.5)
    want = ops.lora_linear(x_t.float().numpy(), w_t.float().numpy(), a, b, 0.5)
    assert got.dtype == dtype
    np.testing.assert_allclose(got.float().numpy(), want, rtol=rtol, atol=atol * np.abs(want).max())


@pytest.mark.parametrize("T,d_in,d_out,r", [(1, 9, 5, 2), (23, 40, 24, 8)])
def test_accel_lora_linear_gradients_match_the_numpy_oracle(T, d_in, d_out, r):
    from accel.ops import lora_linear
    from refimpl.train.grads import lora_linear_backward
    rng = np.random.default_rng(T)
    x, w = rng.standard_normal((T, d_in), np.float32), rng.standard_normal((d_out, d_in), np.float32)
    a, b = rng.standard_normal((r, d_in), np.float32), rng.standard_normal((d_out, r), np.float32)
    d_out_ = rng.standard_normal((T, d_out), np.float32)
    xt, at, bt = (torch.tensor(v, requires_grad=True) for v in (x, a, b))
    lora_linear(xt, torch.from_numpy(w), at, bt, 0.75).backward(torch.from_numpy(d_out_))
    for got, want in zip((xt.grad, at.grad, bt.grad), lora_linear_backward(x, w, a, b, 0.75, d_out_)):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("case", ["plain", "patterns", "lm_head untied"])
def test_unmerged_logits_equal_merged_and_peft(tmp_path, case):
    lora_kwargs, tied = LORA_CASES[case]
    model = peft_adapter(hf_base(tmp_path / "base", tied), tmp_path / "adapter", lora_kwargs)
    ids = [61, 5, 17, 33, 2, 40, 9]
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].numpy()
    ckpt = load_checkpoint(tmp_path / "base", with_tokenizer=False)
    adapter = load_lora(tmp_path / "adapter", ckpt.config)
    unmerged = attach_lora(ckpt.params, adapter)
    assert sum(isinstance(v, LoraWeight) for v in unmerged.values()) == len(adapter)
    got = refimpl_logits(unmerged, ckpt.config, ids)
    merged = refimpl_logits(merge_lora(ckpt.params, ckpt.config, adapter), ckpt.config, ids)
    assert np.abs(got - merged).max() < 1e-4 and np.abs(got - want).max() < 1e-4
    assert np.abs(refimpl_logits(ckpt.params, ckpt.config, ids) - want).max() > 1e-2


def test_generate_unmerged_equals_merged(tmp_path):
    lora_kwargs, tied = LORA_CASES["rslora"]
    peft_adapter(hf_base(tmp_path / "base", tied), tmp_path / "adapter", lora_kwargs)
    runs = {mode: run_cli(generate_args(tmp_path / "base", "--lora", tmp_path / "adapter", "--lora-mode", mode,
                                        "--json", "--max-new-tokens", "6", prompt="w1 w2 w3"))
            for mode in ("merged", "unmerged")}
    assert all(r.exit_code == 0 for r in runs.values()), [r.output for r in runs.values()]
    assert json.loads(runs["merged"].stdout)["generated_ids"] == json.loads(runs["unmerged"].stdout)["generated_ids"]
    refused = run_cli(["generate", "w1", "--model", tmp_path / "base", "--backend", "accel", "--lora",
                       tmp_path / "adapter", "--lora-mode", "unmerged"])
    assert_clean_error(refused, "--lora-mode unmerged", "refimpl")


@pytest.mark.parametrize("case,dtype", [("patterns", torch.float32), ("lm_head untied", torch.float32),
                                        ("plain", torch.bfloat16)])
def test_lora_merge_writes_a_checkpoint_hf_loads(tmp_path, case, dtype):
    lora_kwargs, tied = LORA_CASES[case]
    base = hf_base(tmp_path / "base", tied)
    if dtype != torch.float32:
        base.to(dtype).save_pretrained(tmp_path / "base")
        base = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "base", torch_dtype=torch.float32)
    model = peft_adapter(base, tmp_path / "adapter", lora_kwargs)
    out = tmp_path / "merged"
    result = run_cli(["lora", "merge", "--model", tmp_path / "base", "--adapter", tmp_path / "adapter",
                      "--out", out, "--max-shard-size", "10KB"])
    assert result.exit_code == 0, result.output
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((out / s).exists() for s in shards)
    assert (out / "tokenizer.json").exists() and (out / "config.json").exists()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype="auto").eval()
    assert next(loaded.parameters()).dtype == dtype  # stored in the base's dtype
    want_model = model.merge_and_unload().eval()
    ids = torch.tensor([[61, 5, 17, 33, 2, 40, 9]])
    with torch.no_grad():
        got, want = loaded.float()(ids).logits, want_model.float()(ids).logits
    tol = 1e-4 if dtype == torch.float32 else 0.05 * want.abs().max().item()  # bf16: rounding the merged weights
    assert (got - want).abs().max().item() < tol


def test_lora_merge_refuses_a_nonempty_out(tmp_path):
    lora_kwargs, tied = LORA_CASES["plain"]
    peft_adapter(hf_base(tmp_path / "base", tied), tmp_path / "adapter", lora_kwargs)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("")
    assert_clean_error(run_cli(["lora", "merge", "--model", tmp_path / "base", "--adapter", tmp_path / "adapter",
                                "--out", tmp_path / "out"]), "--out", "not empty")


def test_finetune_and_merge_from_a_gguf_base(tmp_path):
    """A .gguf base trains (its tokenizer and template come from the metadata) and merges into an HF checkpoint
    whose logits equal the refimpl's GGUF base with the adapter merged."""
    from refimpl.formats.params import random_params
    from test_gguf import tiny_config as gguf_config, write_gguf
    cfg = gguf_config()
    path = write_gguf(tmp_path / "m.gguf", cfg, random_params(cfg, seed=3, std=0.2))
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"query": "a b", "response": "b a"}) + "\n")
    result = run_cli(["finetune", "--model", path, "--data", data, "--out", tmp_path / "ad", "--device", "cpu",
                      "--max-steps", 2, "--lr", "0.05", "--target", "q_proj,down_proj", "--json"])
    assert result.exit_code == 0, result.output
    merged = run_cli(["lora", "merge", "--model", path, "--adapter", tmp_path / "ad", "--out", tmp_path / "hf"])
    assert merged.exit_code == 0, merged.output
    ckpt = load_checkpoint(path, with_tokenizer=False)
    adapter = load_lora(tmp_path / "ad", ckpt.config)
    ids = [1, 5, 7, 2, 9]
    want = refimpl_logits(merge_lora(ckpt.params, ckpt.config, adapter), ckpt.config, ids)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        got = loaded(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(got - want).max() < 1e-4
    assert max(np.abs(b).max() for _, _, b, _ in adapter) > 0  # two steps moved B off zero
