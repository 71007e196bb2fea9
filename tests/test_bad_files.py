"""Files and paths the OS makes awkward: FIFOs and devices where a file should be (a hang before), symlink loops,
over-long names, NUL bytes, missing output directories, text that is not UTF-8; and the Hugging Face cache's
symlinked layout, which must load. Every refusal is the one-line contract of _badinput.assert_clean_error.
"""
import json
import os
import shutil
import threading

import numpy as np
import pytest

from _badinput import assert_clean_error, generate_args, make_model, run_cli, tiny_config
from refimpl.errors import CheckpointError, Llama32Error, MAX_LINE_CHARS, one_line, quote
from refimpl.formats.checkpoint import load_checkpoint
from refimpl.formats.params import random_params
from refimpl.formats.safe_open import open_regular, read_bytes
from refimpl.formats.safetensors_io import save_safetensors


def finishes(fn, seconds=20):
    """Run fn in a thread; the test fails (instead of hanging) if it does not return in time."""
    out = {}

    def target():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 (handed back to the test)
            out["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), "hung"
    if "error" in out:
        raise out["error"]
    return out.get("value")


# ---- non-regular files: each reader refuses them without blocking ----
FILES = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
         "generation_config.json"]


@pytest.mark.parametrize("name", FILES)
@pytest.mark.parametrize("kind", ["fifo", "device", "directory"])
def test_non_regular_file_in_model_dir(tmp_path, name, kind):
    model = make_model(tmp_path / "m")
    target = model / name
    if target.exists():
        target.unlink()
    if kind == "fifo":
        os.mkfifo(target)
    elif kind == "device":
        target.symlink_to("/dev/zero")  # reading it never ends
    else:
        target.mkdir()
    result = finishes(lambda: run_cli(generate_args(model, "--chat")))
    expected = {"fifo": "FIFO", "device": "character device", "directory": "directory"}[kind]
    assert_clean_error(result, name, expected)


def test_model_argument_is_a_fifo(tmp_path):
    os.mkfifo(tmp_path / "model.gguf")
    assert_clean_error(finishes(lambda: run_cli(generate_args(tmp_path / "model.gguf"))), "FIFO")
    os.mkfifo(tmp_path / "model")
    assert_clean_error(finishes(lambda: run_cli(generate_args(tmp_path / "model"))), "model")


def test_shard_and_adapter_fifos(tmp_path):
    model = make_model(tmp_path / "m")
    shard = model / "model-00001-of-00001.safetensors"
    (model / "model.safetensors").rename(shard)
    names = json.loads(json.dumps(list(load_checkpoint_names(shard))))
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {n: shard.name for n in names}}))
    assert load_checkpoint(model, with_tokenizer=False).params  # the sharded layout itself is fine
    shard.unlink()
    os.mkfifo(shard)
    assert_clean_error(finishes(lambda: run_cli(generate_args(model))), shard.name, "not a file")
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    os.mkfifo(adapter / "adapter_config.json")
    shard.unlink()
    make_model(tmp_path / "m2")
    assert_clean_error(finishes(lambda: run_cli(generate_args(tmp_path / "m2", "--lora", adapter))),
                       "adapter_config.json", "FIFO")


def load_checkpoint_names(path):
    from refimpl.formats.safetensors_io import SafetensorsFile
    return SafetensorsFile(path).names()


def test_open_regular_never_blocks(tmp_path):
    os.mkfifo(tmp_path / "p")
    with pytest.raises(CheckpointError, match="FIFO"):
        finishes(lambda: open_regular(tmp_path / "p"), seconds=5)
    with pytest.raises(CheckpointError, match="more than"):
        read_bytes(__file__, limit=10)


# ---- paths the OS refuses ----
def test_symlink_loop(tmp_path):
    model = make_model(tmp_path / "m")
    (model / "config.json").unlink()
    (model / "config.json").symlink_to(model / "config.json")
    assert_clean_error(run_cli(generate_args(model)), "config.json", "symbolic links")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    assert_clean_error(run_cli(generate_args(tmp_path / "loop")), "symbolic links")


def test_name_too_long(tmp_path):
    message = assert_clean_error(run_cli(generate_args(tmp_path / ("x" * 5000))))
    assert "too long" in message and len(message) <= MAX_LINE_CHARS


@pytest.mark.parametrize("option", ["--model", "--lora"])
def test_nul_in_path_argument(tmp_path, option):
    model = make_model(tmp_path / "m")
    args = generate_args(f"{model}\0x") if option == "--model" else generate_args(model, "--lora", "a\0b")
    assert_clean_error(run_cli(args), "NUL")


def test_nul_in_shard_name(tmp_path):
    model = make_model(tmp_path / "m")
    names = load_checkpoint_names(model / "model.safetensors")
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {n: "a\u0000b" for n in names}}))
    assert_clean_error(run_cli(generate_args(model)), "NUL")


@pytest.mark.parametrize("shard", ["/etc/passwd", "../m2/model.safetensors", "sub/../../m2/model.safetensors",
                                   "C:\\x.safetensors", "..\\m2\\model.safetensors"])
def test_index_names_leaving_the_directory(tmp_path, shard):
    make_model(tmp_path / "m2")
    model = make_model(tmp_path / "m")
    names = load_checkpoint_names(model / "model.safetensors")
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {n: shard for n in names}}))
    assert_clean_error(run_cli(generate_args(model)), "no absolute path", "names shard")


@pytest.mark.parametrize("command", ["diff", "golden-make", "step-dump"])
def test_output_into_missing_directory(tmp_path, command):
    model = make_model(tmp_path / "m")
    missing = tmp_path / "nope" / "out.safetensors"
    if command == "diff":
        args = ["diff", "w1 w2", "--model", model, "--b", "refimpl", "--dump", missing]
        assert_clean_error(run_cli(args), "--dump", "does not exist")
    elif command == "golden-make":
        assert_clean_error(run_cli(["golden", "make", "--out", tmp_path / "nope" / "deeper"]), "--out",
                           "does not exist")
    else:  # the session reports it and goes on to the next command; the script then exits 2 (a command failed)
        result = run_cli(["step", "w1 w2", "--model", model, "--commands", f"dump {missing}; dump a\0b; q"])
        assert result.exit_code == 2, result.output
        errors = [ln for ln in result.output.splitlines() if ln.startswith("error:")]
        assert len(errors) == 3 and "No such file" in errors[0], errors
        assert "NUL" in errors[1] and errors[2].startswith("error: 2 scripted command(s) failed")


def test_prompt_with_lone_surrogates(tmp_path):
    model = make_model(tmp_path / "m")
    prompt = os.fsdecode(b"w1 \xff w2")  # what Python makes of a non-UTF-8 argv byte
    (model / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert_clean_error(run_cli(generate_args(model, prompt=prompt)), "not valid UTF-8")
    assert_clean_error(run_cli(generate_args(model, "--chat", prompt=prompt)), "not valid UTF-8")


@pytest.mark.parametrize("seed", [2 ** 64, 2 ** 200, -1])
def test_seed_beyond_64_bits(tmp_path, seed):
    model = make_model(tmp_path / "m")
    assert_clean_error(run_cli(generate_args(model, "--seed", seed, "--temperature", "1")), "--seed")


def test_range_errors_are_error_lines_usage_errors_stay_click_s(tmp_path):
    model = make_model(tmp_path / "m")
    assert_clean_error(run_cli(["diff", "w1", "--model", model, "--b", "refimpl", "--steps", "-1"]),
                       "--steps must be between 0 and 1024, got -1")
    usage = run_cli(generate_args(model, "--max-new-tokens", "ten"))
    assert usage.exit_code == 2 and "Usage:" in usage.output and "'ten' is not a valid integer" in usage.output


# ---- the HF cache: snapshots/<rev>/ of relative symlinks into blobs/ ----
def hf_cache_layout(root, model):
    """What huggingface_hub's snapshot_download leaves: blobs named by hash, snapshot files linking to them."""
    repo = root / "models--someone--tiny"
    blobs, snap = repo / "blobs", repo / "snapshots" / "0123abcd"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for i, f in enumerate(sorted(model.iterdir())):
        blob = blobs / f"{i:064x}"
        shutil.copyfile(f, blob)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    return snap


def test_sharded_hf_cache_model_loads(tmp_path):
    cfg = tiny_config()
    params = random_params(cfg)
    src = tmp_path / "src"
    make_model(src, cfg, params)
    (src / "model.safetensors").unlink()
    names = list(params)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for shard, part in halves.items():
        save_safetensors(src / shard, {n: params[n] for n in part}, dtype="BF16")
    (src / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: s for s, part in halves.items() for n in part}}))
    snap = hf_cache_layout(tmp_path / "hub", src)
    assert all((snap / s).is_symlink() for s in halves)
    cached, plain = load_checkpoint(snap), load_checkpoint(src)
    assert cached.params.keys() == plain.params.keys()
    for n in plain.params:
        np.testing.assert_array_equal(cached.params[n], plain.params[n])
    result = run_cli(generate_args(snap))
    assert result.exit_code == 0, result.output


def test_symlink_to_a_fifo_is_still_refused(tmp_path):
    model = make_model(tmp_path / "m")
    os.mkfifo(tmp_path / "blob")
    (model / "config.json").unlink()
    (model / "config.json").symlink_to("../blob")
    assert_clean_error(finishes(lambda: run_cli(generate_args(model))), "FIFO")


# ---- shards that disagree, weights that are not floats ----
def test_tensor_in_two_shards(tmp_path):
    cfg = tiny_config()
    params = random_params(cfg)
    model = make_model(tmp_path / "m", cfg, params)
    (model / "model.safetensors").rename(model / "a.safetensors")
    save_safetensors(model / "b.safetensors", {"model.norm.weight": params["model.norm.weight"] * 2,
                                               "x.extra": np.ones(2, np.float32)})
    wm = {n: "a.safetensors" for n in params}
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm | {"x.extra": "b.safetensors"}}))
    assert_clean_error(run_cli(generate_args(model)), "model.norm.weight", "more than one shard")


def test_index_listing_a_tensor_twice(tmp_path):
    model = make_model(tmp_path / "m")
    names = load_checkpoint_names(model / "model.safetensors")
    body = ", ".join(f'"{n}": "model.safetensors"' for n in names + [names[0]])
    (model / "model.safetensors.index.json").write_text('{"weight_map": {' + body + "}}")
    assert_clean_error(run_cli(generate_args(model)), "duplicate key", names[0])


@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.uint8, np.bool_, np.int64])
def test_integer_weights_are_refused(tmp_path, dtype):
    params = random_params(tiny_config())
    params["model.layers.1.mlp.up_proj.weight"] = np.ones((32, 16), dtype)
    model = make_model(tmp_path / "m", params=params)
    assert_clean_error(run_cli(generate_args(model)), "model.layers.1.mlp.up_proj.weight", "a weight must be one of")


# ---- messages stay one short line ----
def test_huge_tensor_name_and_newline_directory(tmp_path):
    params = random_params(tiny_config())
    params["y" * 100_000] = np.ones(2, np.float32)
    del params["model.norm.weight"]
    model = make_model(tmp_path / "dir\nwith newline", params=params)
    message = assert_clean_error(run_cli(generate_args(model)), "model.norm.weight")
    assert len(message) <= MAX_LINE_CHARS and "\\n" in message


def test_raise_exception_message_with_newlines(tmp_path):
    model = make_model(tmp_path / "m")
    (model / "chat_template.jinja").write_text("{{ raise_exception('line one\\nline two' * 100) }}")
    message = assert_clean_error(run_cli(generate_args(model, "--chat")), "chat template: line one\\nline two")
    assert len(message) <= MAX_LINE_CHARS


def test_quote_and_one_line():
    assert quote("a\nb") == "'a\\nb'" and len(quote("x" * 10 ** 5)) <= 80
    assert quote(os.fsdecode(b"\xff")) == "'\\udcff'"
    line = one_line("bad " + "z" * 10 ** 5 + " and \x00\r\n " + os.fsdecode(b"\xfe"))
    assert len(line) <= MAX_LINE_CHARS and "\n" not in line and "\x00" not in line
    line.encode("utf-8")  # printable on any terminal
    assert str(Llama32Error("a\nb")) == "a\\nb"


@pytest.mark.parametrize("field, value, message", [
    ("ids", [10 ** 9], "token id 1000000000, outside the vocabulary"), ("ids", [-1], "token id -1"),
    ("positions", [2 ** 70], "position"),
])
def test_golden_manifest_out_of_range(tmp_path, field, value, message):
    from pathlib import Path
    src = Path(__file__).resolve().parents[1] / "golden" / "toy-gqa"
    d = shutil.copytree(src, tmp_path / "toy-gqa")
    manifest = json.loads((d / "golden.json").read_text())
    manifest["steps"][1][field] = value
    (d / "golden.json").write_text(json.dumps(manifest))
    assert_clean_error(run_cli(["golden", "check", "--golden", d]), "golden.json", message)


def test_nul_in_dump_option(tmp_path):
    model = make_model(tmp_path / "m")
    assert_clean_error(run_cli(["diff", "w1", "--model", model, "--b", "refimpl", "--dump", "x\0.st"]), "--dump", "NUL")
