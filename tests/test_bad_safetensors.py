"""Malformed safetensors files and shard indexes, each crafted here from a valid tiny model and run through the CLI.

Each case must end in one `error:` line naming the file and what was expected, exit 2, no traceback.
"""
import json
import struct

import pytest

from _badinput import (assert_clean_error, generate_args, make_model, read_safetensors, run_cli,
                       write_raw_safetensors)

EMBED = "model.embed_tokens.weight"


def _first_two(header):
    """Names of the first two tensors in data order."""
    spans = sorted((v["data_offsets"][0], k) for k, v in header.items() if k != "__metadata__")
    return spans[0][1], spans[1][1]


def edits_header(change):
    """A corruption made by `change(header)` alone: the file rewritten with the edited header, the same data."""
    def corrupt(path):
        header, data = read_safetensors(path)
        change(header)
        write_raw_safetensors(path, header, data)
    return corrupt


def short_file(path):
    path.write_bytes(b"\x01\x02\x03")


def header_past_end(path):
    header, data = read_safetensors(path)
    raw = json.dumps(header).encode()
    write_raw_safetensors(path, raw, data, header_len=len(raw) + len(data) + 1)  # one byte more than is there


def header_over_limit(path):
    header, data = read_safetensors(path)
    write_raw_safetensors(path, header, data, header_len=200 * 1024 * 1024)


def header_not_utf8(path):
    _, data = read_safetensors(path)
    write_raw_safetensors(path, b'{"a\xff\xfe": 1}', data)


def header_not_json(path):
    _, data = read_safetensors(path)
    write_raw_safetensors(path, b'{"model.norm.weight": {"dtype": "F32",', data)


def header_not_object(path):
    _, data = read_safetensors(path)
    write_raw_safetensors(path, b"[1, 2, 3]", data)


def header_deeply_nested(path):
    _, data = read_safetensors(path)
    write_raw_safetensors(path, b"[" * 200_000 + b"]" * 200_000, data)


def duplicate_names(path):
    header, data = read_safetensors(path)
    raw = json.dumps(header)
    entry = json.dumps(header[EMBED])
    raw = raw[:-1] + f', "{EMBED}": {entry}}}'  # the same key twice: json.loads alone would keep the last
    write_raw_safetensors(path, raw.encode(), data)


def offsets_out_of_range(path):
    header, data = read_safetensors(path)
    begin, end = header[EMBED]["data_offsets"]
    header[EMBED]["data_offsets"] = [begin + len(data), end + len(data)]
    write_raw_safetensors(path, header, data)


@edits_header
def offsets_negative(header):
    header[EMBED]["data_offsets"] = [-4, header[EMBED]["data_offsets"][1] - 4]


@edits_header
def offsets_overlap(header):
    a, b = _first_two(header)
    width = header[b]["data_offsets"][1] - header[b]["data_offsets"][0]
    start = header[a]["data_offsets"][1] - 4  # start b inside a, same length: sizes still agree with shapes
    header[b]["data_offsets"] = [start, start + width]


def offsets_gap(path):
    header, data = read_safetensors(path)
    for v in header.values():
        if isinstance(v, dict) and "data_offsets" in v:
            v["data_offsets"] = [o + 8 for o in v["data_offsets"]]
    write_raw_safetensors(path, header, b"\0" * 8 + data)


@edits_header
def size_mismatch(header):
    header[EMBED]["shape"] = [header[EMBED]["shape"][0] + 1, header[EMBED]["shape"][1]]


@edits_header
def unknown_dtype(header):
    header[EMBED]["dtype"] = "Q4"


@edits_header
def dtype_not_string(header):
    header[EMBED]["dtype"] = ["F32"]


@edits_header
def shape_not_ints(header):
    header[EMBED]["shape"] = [64.0, "16"]


@edits_header
def extra_field(header):
    header[EMBED]["quant"] = "nf4"


def trailing_bytes(path):
    header, data = read_safetensors(path)
    write_raw_safetensors(path, header, data + b"\0" * 12)


@edits_header
def metadata_not_strings(header):
    header["__metadata__"] = {"format": 1}


def truncated_download(path):
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])


def is_directory(path):
    path.unlink()
    path.mkdir()


CASES = {
    "shorter than 8 bytes": (short_file, "shorter than the 8-byte header length"),
    "header length past the file": (header_past_end, "runs past the end"),
    "header length over 100 MB": (header_over_limit, "100 MB limit"),
    "header not UTF-8": (header_not_utf8, "header is not UTF-8"),
    "header not JSON": (header_not_json, "header is not valid JSON"),
    "header not an object": (header_not_object, "not a JSON object"),
    "header nested 200k deep": (header_deeply_nested, "nested too deeply"),
    "duplicate tensor names": (duplicate_names, "duplicate key"),
    "offsets out of range": (offsets_out_of_range, "out of range"),
    "offsets negative": (offsets_negative, "out of range"),
    "offsets overlapping": (offsets_overlap, "overlap"),
    "offsets leaving a gap": (offsets_gap, "gap of 8 bytes"),
    "data size != shape x dtype": (size_mismatch, "needs"),
    "unknown dtype": (unknown_dtype, "unknown dtype 'Q4'"),
    "dtype not a string": (dtype_not_string, "unknown dtype"),
    "shape not integers": (shape_not_ints, "shape must be a list of non-negative integers"),
    "unexpected entry field": (extra_field, "expected exactly dtype, shape and data_offsets"),
    "trailing bytes": (trailing_bytes, "12 trailing bytes"),
    "metadata not strings": (metadata_not_strings, "__metadata__ must map strings to strings"),
    "truncated download (cut in half)": (truncated_download, "truncated download"),
    "model.safetensors is a directory": (is_directory, "is a directory"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_safetensors_file(tmp_path, case):
    corrupt, expected = CASES[case]
    model = make_model(tmp_path / "m")
    corrupt(model / "model.safetensors")
    assert_clean_error(run_cli(generate_args(model)), "model.safetensors", expected)


def test_debug_flag_shows_the_traceback(tmp_path):
    model = make_model(tmp_path / "m")
    trailing_bytes(model / "model.safetensors")
    result = run_cli(["--debug", *generate_args(model)])
    assert result.exit_code != 0 and "trailing bytes" in str(result.exception)
    assert type(result.exception).__name__ == "CheckpointError"


# ---- sharded checkpoints ----
def shard(model):
    """Split model.safetensors into two shards plus an index, as HF writes large checkpoints."""
    from refimpl.formats.safetensors_io import SafetensorsFile, save_safetensors
    st = SafetensorsFile(model / "model.safetensors")
    names = st.names()
    parts = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
             "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, part in parts.items():
        save_safetensors(model / file, {n: st.load(n) for n in part})
    (model / "model.safetensors").unlink()
    weight_map = {n: file for file, part in parts.items() for n in part}
    (model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return weight_map


def edit_index(model, fn):
    path = model / "model.safetensors.index.json"
    d = json.loads(path.read_text())
    fn(d["weight_map"])
    path.write_text(json.dumps(d))


def test_sharded_checkpoint_loads(tmp_path):
    model = make_model(tmp_path / "m")
    shard(model)
    result = run_cli(generate_args(model))
    assert result.exit_code == 0, result.output


def test_index_names_missing_shard(tmp_path):
    model = make_model(tmp_path / "m")
    shard(model)
    (model / "model-00002-of-00002.safetensors").unlink()
    assert_clean_error(run_cli(generate_args(model)), "model.safetensors.index.json",
                       "names shard 'model-00002-of-00002.safetensors', which is not a file")


def test_index_shard_outside_the_directory(tmp_path):
    model = make_model(tmp_path / "m")
    shard(model)
    (tmp_path / "elsewhere.safetensors").write_bytes(b"")
    edit_index(model, lambda wm: wm.update({"model.norm.weight": "../elsewhere.safetensors"}))
    assert_clean_error(run_cli(generate_args(model)), "names shard '../elsewhere.safetensors'")


def test_index_tensor_in_no_shard(tmp_path):
    model = make_model(tmp_path / "m")
    weight_map = shard(model)
    wrong = next(f for n, f in weight_map.items() if n != "model.norm.weight" and f != weight_map["model.norm.weight"])
    edit_index(model, lambda wm: wm.update({"model.norm.weight": wrong}))
    assert_clean_error(run_cli(generate_args(model)), "tensor 'model.norm.weight' is listed in", wrong,
                       "does not contain it")


def test_index_missing_a_tensor(tmp_path):
    model = make_model(tmp_path / "m")
    shard(model)
    edit_index(model, lambda wm: wm.pop("model.layers.1.mlp.up_proj.weight"))
    assert_clean_error(run_cli(generate_args(model)), "missing tensor 'model.layers.1.mlp.up_proj.weight'")


@pytest.mark.parametrize("content, expected", [
    ("{not json", "not valid JSON"),
    (json.dumps({"metadata": {}}), "expected a 'weight_map' object"),
    (json.dumps({"weight_map": {"model.norm.weight": 3}}), "expected a 'weight_map' object"),
    (json.dumps([1]), "expected a JSON object"),
])
def test_bad_index_file(tmp_path, content, expected):
    model = make_model(tmp_path / "m")
    shard(model)
    (model / "model.safetensors.index.json").write_text(content)
    assert_clean_error(run_cli(generate_args(model)), "model.safetensors.index.json", expected)


def test_shards_without_index(tmp_path):
    model = make_model(tmp_path / "m")
    shard(model)
    (model / "model.safetensors.index.json").unlink()
    assert_clean_error(run_cli(generate_args(model)), "no model.safetensors or model.safetensors.index.json",
                       "without an index")


def test_header_length_field_alone_allocates_nothing(tmp_path):
    """A 16-byte file claiming a 99 MB header is refused before any read of that size."""
    import tracemalloc
    from refimpl.errors import CheckpointError
    from refimpl.formats.safetensors_io import SafetensorsFile
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", 99 * 1024 * 1024) + b"{}      ")
    tracemalloc.start()
    with pytest.raises(CheckpointError, match="runs past the end"):
        SafetensorsFile(path)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 1024 * 1024
