"""Quantized checkpoints (`llama32 quantize`, refimpl.formats.quant_checkpoint): the written layout, the round trip
into QuantizedLinear records, loading in both engines (accel on the CPU takes the stored codes as they are), the
calibrated driver, and the errors for checkpoints that do not hold what their config says."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from _badinput import assert_clean_error, read_safetensors, run_cli, write_raw_safetensors
from refimpl.errors import CheckpointError, ConfigError
from refimpl.formats.checkpoint import load_checkpoint
from refimpl.formats.safetensors_io import SafetensorsFile
from refimpl.generate import RefEngine, Sampling
from refimpl.model import ops
from refimpl.model.llama import KVCache, forward
from refimpl.quant.apply import quantized_names
from refimpl.quant.calibrate import calibration_sequences, quantize_model
from refimpl.errors import QuantError
from refimpl.quant.schemes import MIXED_INT8, QuantizedLinear, QuantSpec

TOY = Path(__file__).resolve().parent.parent / "golden" / "toy-gqa"
CALIB = ("Call me Ishmael. Some years ago, having little or no money in my purse, and nothing particular to interest "
         "me on shore, I thought I would sail about a little and see the watery part of the world. ") * 6


@pytest.fixture(scope="module")
def quantized_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("q") / "toy-int4"
    r = run_cli(["quantize", "--model", TOY, "--quant", "int4:64", "--method", "gptq", "--calib",
                 _calib_file(out.parent), "--out", out])
    assert r.exit_code == 0, r.output
    return out


def _calib_file(d: Path) -> Path:
    path = d / "calib.txt"
    path.write_text(CALIB)
    return path


def logits(params, cfg, ids):
    cache = KVCache.allocate(cfg, len(ids), lambda s: np.zeros(s, np.float32))
    return forward(ops, params, cfg, np.asarray(ids), np.arange(len(ids)), cache)


def test_quantize_writes_the_documented_layout(quantized_dir):
    config = json.loads((quantized_dir / "config.json").read_text())
    q = config["quantization_config"]
    assert q["quant_method"] == "llama32" and q["format"] == "int4" and q["group_size"] == 64
    assert q["method"] == "gptq" and q["lm_head"] is True and "calib.txt" in q["calibration"]
    st = SafetensorsFile(quantized_dir / "model.safetensors")
    t = st.tensors
    N, K = 2 * 16, 64  # toy-gqa: k_proj is [kv_heads · head_dim, hidden]
    assert (t["model.layers.0.self_attn.k_proj.qweight"].dtype, t["model.layers.0.self_attn.k_proj.qweight"].shape) \
        == ("U8", (N, K // 2))
    assert (t["model.layers.0.self_attn.k_proj.scales"].dtype, t["model.layers.0.self_attn.k_proj.scales"].shape) \
        == ("BF16", (N, 1))
    assert t["model.layers.0.mlp.down_proj.mins"].shape == (64, 3)  # K = 192: three groups of 64
    assert "lm_head.qweight" in t and "model.embed_tokens.weight" in t  # tied: the head quantized on its own
    assert not any(name.endswith("proj.weight") for name in t)
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (quantized_dir / f).is_file()


def test_round_trip_keeps_every_bit(tmp_path):
    """Records written and read back are the same arrays; the model computes the same logits."""
    src = load_checkpoint(TOY)
    spec = QuantSpec.parse("int8:bf16-head")
    params = quantize_model(src.params, src.config, spec, "search")
    out = tmp_path / "q8"
    from refimpl.formats.checkpoint import write_side_files
    from refimpl.formats.quant_checkpoint import quantization_config, save_quantized_weights
    save_quantized_weights(out, params)
    write_side_files(src, out, src.config.to_hf() | {"quantization_config": quantization_config(spec, "search", None)})
    back = load_checkpoint(out)
    assert back.config == src.config and back.stop_ids == src.stop_ids
    assert back.tokenizer.encode("hello world") == src.tokenizer.encode("hello world")
    names = quantized_names(src.config, lm_head=False)
    assert "lm_head.weight" not in back.params
    for name, value in params.items():
        got = back.params[name]
        if name in names:
            assert isinstance(got, QuantizedLinear) and got.format == "int8" and got.group == value.group
            assert np.array_equal(got.data, value.data) and got.data.dtype == np.int8
            assert np.array_equal(got.scales, value.scales)
        else:
            assert np.array_equal(got, value)
    ids = src.tokenizer.encode("the watery part of the world")
    np.testing.assert_array_equal(logits(back.params, back.config, ids), logits(params, src.config, ids))


def test_mixed_spec_round_trips_and_loads_in_both_engines(tmp_path):
    """int4:64:mixed (q/k/v, down_proj and the lm_head in int8) through `llama32 quantize`: the config names the
    int8 matrices, every record comes back in its own format, and accel uploads the stored codes of both formats as
    they are."""
    torch = pytest.importorskip("torch")
    from accel.engine import AccelEngine
    out = tmp_path / "mixed"
    r = run_cli(["quantize", "--model", TOY, "--quant", "int4:64:mixed", "--method", "awq-gptq", "--calib",
                 _calib_file(tmp_path), "--out", out])
    assert r.exit_code == 0, r.output
    q = json.loads((out / "config.json").read_text())["quantization_config"]
    assert q["format"] == "int4" and q["int8_matrices"] == list(MIXED_INT8) and q["method"] == "awq-gptq"
    back = load_checkpoint(out)
    formats = {n: back.params[n].format for n in quantized_names(back.config, True)}
    int8 = ("down_proj", "q_proj", "k_proj", "v_proj", "lm_head")
    assert {f for n, f in formats.items() if any(k in n for k in int8)} == {"int8"}
    assert {f for n, f in formats.items() if not any(k in n for k in int8)} == {"int4"}
    acc = AccelEngine.from_checkpoint(back, device="cpu", dtype="fp32", use_triton=False)
    lw = acc.weights.layers[2]
    assert (lw.down.fmt, lw.qkv.fmt, lw.gate_up.fmt, lw.o.fmt, acc.weights.lm_head.fmt) == (
        "int8", "int8", "int4", "int4", "int8")
    down = lw.down
    assert np.array_equal(down.q.numpy(), back.params["model.layers.2.mlp.down_proj.weight"].data)
    prompt, s = back.tokenizer.encode("the sea"), Sampling(max_new_tokens=3)
    with torch.no_grad():
        assert list(acc.generate(prompt, s)) == list(RefEngine(back).generate(prompt, s))


def test_calibrated_quantization_tracks_the_model_better_than_round_to_nearest():
    """On the toy model (random weights): GPTQ's logits are closer to the unquantized ones than RTN's."""
    src = load_checkpoint(TOY)
    cfg, spec = src.config, QuantSpec.parse("int4:64")
    seqs = calibration_sequences(src.tokenizer, CALIB, seq_len=128)
    assert all(s[0] == src.tokenizer.bos_id for s in seqs) and len(seqs) > 1
    ids = src.tokenizer.encode("It was the best of times, it was the worst of times.")
    ref = logits(src.params, cfg, ids)
    err = {m: np.mean((logits(quantize_model(src.params, cfg, spec, m, seqs), cfg, ids) - ref) ** 2)
           for m in ("rtn", "gptq")}
    assert err["gptq"] < err["rtn"]


def test_generate_loads_it_in_the_refimpl(quantized_dir):
    r = run_cli(["generate", "--model", quantized_dir, "--backend", "refimpl", "--max-new-tokens", "4", "--json",
                 "hello"])
    assert r.exit_code == 0, r.output
    back = load_checkpoint(quantized_dir)
    assert all(isinstance(back.params[n], QuantizedLinear) for n in quantized_names(back.config, True))


def test_accel_runs_the_stored_codes_as_they_are(quantized_dir):
    torch = pytest.importorskip("torch")
    from accel.engine import AccelEngine
    ckpt = load_checkpoint(quantized_dir)
    # torch ops: the loading is under test here; the Triton GEMVs on these records are test_quant_accel's
    acc = AccelEngine.from_checkpoint(ckpt, device="cpu", dtype="fp32", use_triton=False)
    o = acc.weights.layers[1].o
    stored = ckpt.params["model.layers.1.self_attn.o_proj.weight"]
    assert type(o).__name__ == "QuantTensor"
    assert np.array_equal(o.q.numpy(), stored.data)  # uploaded, not re-quantized
    assert np.array_equal(o.scale.float().numpy(), stored.scales) and np.array_equal(o.low.float().numpy(),
                                                                                     stored.mins)
    prompt, s = ckpt.tokenizer.encode("the sea"), Sampling(max_new_tokens=3)
    with torch.no_grad():
        assert list(acc.generate(prompt, s)) == list(RefEngine(ckpt).generate(prompt, s))


def test_requantizing_or_merging_into_it_is_refused(quantized_dir):
    r = run_cli(["generate", "--model", quantized_dir, "--backend", "refimpl", "--quant", "int8", "hi"])
    assert r.exit_code == 2 and "already quantized" in r.output and "Traceback" not in r.output
    with pytest.raises(QuantError, match="already quantized"):
        load_checkpoint(quantized_dir, quant=QuantSpec.parse("int4"))


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_tensor(model_dir: Path, name: str, **header):
    path = model_dir / "model.safetensors"
    head, data = read_safetensors(path)
    head[name].update(header)
    write_raw_safetensors(path, head, data)


def test_bad_quantized_checkpoints_name_the_tensor(quantized_dir, tmp_path):
    name = "model.layers.0.mlp.down_proj.scales"
    bad = _copy(quantized_dir, tmp_path / "dtype")
    _edit_tensor(bad, name, dtype="F16")  # same byte size, wrong dtype
    with pytest.raises(CheckpointError, match=rf"{name}.*F16.*expected BF16 \[64, 3\]"):
        load_checkpoint(bad)
    bad = _copy(quantized_dir, tmp_path / "shape")
    _edit_tensor(bad, name, shape=[3, 64])
    with pytest.raises(CheckpointError, match=rf"{name}.*\[3, 64\].*expected BF16 \[64, 3\]"):
        load_checkpoint(bad)
    bad = _copy(quantized_dir, tmp_path / "missing")
    head, data = read_safetensors(bad / "model.safetensors")
    head["model.layers.1.self_attn.q_proj.minima"] = head.pop("model.layers.1.self_attn.q_proj.mins")  # renamed
    write_raw_safetensors(bad / "model.safetensors", head, data)
    with pytest.raises(CheckpointError, match="missing tensor 'model.layers.1.self_attn.q_proj.mins'"):
        load_checkpoint(bad)
    r = run_cli(["generate", "--model", bad, "--backend", "refimpl", "hi"])
    assert r.exit_code == 2 and r.output.startswith("error:") and "Traceback" not in r.output


@pytest.mark.parametrize("change, message", [
    ({"quant_method": "gptq"}, "quant_method 'gptq' is not supported"),
    ({"format": "int3"}, "format 'int3'"),
    ({"group_size": 48}, "group_size 48"),
    ({"version": 2}, "version 2"),
    ({"int8_matrices": ["mlp.down"]}, "int8_matrices.*expected a list of matrix names"),
    ({"int8_matrices": [["mlp.down_proj"]]}, "int8_matrices.*expected a list of matrix names"),
    ({"int8_matrices": "mlp.down_proj"}, "int8_matrices.*expected a list of matrix names"),
    ({"int8_matrices": ["self_attn.v_proj"]}, "int8_matrices.*one fused matrix.*list all 3 or none"),
    ({"int8_matrices": ["mlp.up_proj", "mlp.down_proj"]}, "int8_matrices.*mlp.gate_proj / mlp.up_proj"),
])
def test_bad_quantization_config_is_refused(quantized_dir, tmp_path, change, message):
    bad = _copy(quantized_dir, tmp_path / "cfg")
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"].update(change)
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=message):
        load_checkpoint(bad)
    if "int8_matrices" in change:  # the CLI: one line naming the file and the field
        assert_clean_error(run_cli(["generate", "--model", bad, "--backend", "refimpl", "hi"]), "config.json",
                           "int8_matrices")


def test_quantize_cli_errors(tmp_path, quantized_dir):
    r = run_cli(["quantize", "--model", TOY, "--quant", "gguf", "--out", tmp_path / "x"])
    assert r.exit_code == 2 and "int8 or int4" in r.output
    r = run_cli(["quantize", "--model", TOY, "--quant", "int8", "--out", quantized_dir])
    assert r.exit_code == 2 and "exists and holds a model checkpoint; choose a new directory" in r.output
    r = run_cli(["quantize", "--model", TOY, "--quant", "int8", "--method", "gptq", "--calib",
                 tmp_path / "none.txt", "--out", tmp_path / "y"])
    assert r.exit_code == 2 and "none.txt" in r.output
    for rotate in ([], ["--rotate"]):  # rotating first must not turn the refusal into a traceback
        r = run_cli(["quantize", "--model", quantized_dir, "--quant", "int8", "--method", "rtn", *rotate,
                     "--out", tmp_path / f"again{len(rotate)}"])
        assert_clean_error(r, "already quantized")


def test_quantize_refuses_a_vision_model_from_its_config(tmp_path):
    """Refused from config.json alone: the directory holds no weights, so reading them first would fail otherwise."""
    model = tmp_path / "vision"
    model.mkdir()
    shutil.copy(TOY.parent / "toy-vision" / "config.json", model)
    r = run_cli(["quantize", "--model", model, "--quant", "int8", "--method", "rtn", "--out", tmp_path / "out"])
    assert_clean_error(r, str(model / "config.json"), "mllama", "text Llama")
    assert not (tmp_path / "out").exists()


def test_quantize_reads_config_json_once(tmp_path, monkeypatch):
    """The Vision refusal and the load share one read of config.json."""
    from refimpl.formats import hf_dir, jsonfile
    reads = []

    def counting(path, *args, **kwargs):
        reads.append(Path(path).name)
        return read(path, *args, **kwargs)
    read = jsonfile.read_json_object
    for module in (jsonfile, hf_dir):
        monkeypatch.setattr(module, "read_json_object", counting)
    r = run_cli(["quantize", "--model", TOY, "--quant", "int8", "--method", "rtn", "--out", tmp_path / "out"])
    assert r.exit_code == 0, r.output
    assert reads.count("config.json") == 1, reads
