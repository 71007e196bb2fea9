"""Malformed GGUF files, crafted byte by byte here, against refimpl.formats.gguf_check.validate_gguf (and the CLI).

The crafting helpers write the GGUF v3 layout directly with `struct`, so each bad file differs from a valid one in
exactly the field under test; `test_crafted_valid_file_reads_back` checks the helpers against gguf's own reader.
"""
import struct
import tracemalloc

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from _badinput import assert_clean_error, generate_args, run_cli  # noqa: E402
from refimpl.errors import CheckpointError  # noqa: E402
from refimpl.formats.gguf_check import validate_gguf  # noqa: E402

T = gguf.GGMLQuantizationType
V = gguf.GGUFValueType


def gstr(s) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def kv(key, vtype, payload: bytes) -> bytes:
    return gstr(key) + struct.pack("<I", vtype) + payload


def tensor_info(name, dims, ttype, offset) -> bytes:
    return (gstr(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
            + struct.pack("<II", ttype, 0)[:4] + struct.pack("<Q", offset))


def valid_parts() -> dict:
    q8 = gguf.quants.quantize(np.linspace(-1, 1, 32, dtype=np.float32)[None], T.Q8_0).tobytes()  # 34 bytes
    data = (np.arange(8, dtype=np.float32).tobytes() + b"\0" * 0  # t0: 32 bytes at 0
            + np.ones(64, np.float16).tobytes()  # t1: 128 bytes at 32
            + q8)  # t2: 34 bytes at 160
    return dict(
        magic=b"GGUF", version=3, alignment=32, data=data,
        kvs=[kv("general.architecture", V.STRING, gstr("llama")),
             kv("llama.block_count", V.UINT32, struct.pack("<I", 1)),
             kv("tokenizer.ggml.tokens", V.ARRAY, struct.pack("<IQ", V.STRING, 3) + gstr("a") + gstr("b") + gstr("c")),
             kv("tokenizer.ggml.scores", V.ARRAY, struct.pack("<IQ", V.FLOAT32, 3) + b"\0" * 12)],
        infos=[tensor_info("t0", [8], T.F32, 0), tensor_info("t1", [32, 2], T.F16, 32),
               tensor_info("t2", [32], T.Q8_0, 160)],
        n_tensors=None, n_kv=None)


def build(p: dict) -> bytes:
    head = p["magic"] + struct.pack("<I", p["version"])
    head += struct.pack("<QQ", len(p["infos"]) if p["n_tensors"] is None else p["n_tensors"],
                        len(p["kvs"]) if p["n_kv"] is None else p["n_kv"])
    body = head + b"".join(p["kvs"]) + b"".join(p["infos"])
    return body + b"\0" * (-len(body) % p["alignment"]) + p["data"]


def write(tmp_path, p: dict | bytes, name="bad.gguf"):
    path = tmp_path / name
    path.write_bytes(p if isinstance(p, bytes) else build(p))
    return path


def test_crafted_valid_file_reads_back(tmp_path):
    path = write(tmp_path, valid_parts())
    validate_gguf(path)
    reader = gguf.GGUFReader(path)
    assert [(t.name, t.tensor_type, t.shape.tolist()) for t in reader.tensors] == [
        ("t0", T.F32, [8]), ("t1", T.F16, [32, 2]), ("t2", T.Q8_0, [32])]
    assert np.array_equal(reader.tensors[0].data, np.arange(8, dtype=np.float32))


def test_gguf_writer_file_passes(tmp_path):
    path = tmp_path / "w.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(1)
    w.add_custom_alignment(64)
    w.add_array("tokenizer.ggml.tokens", ["a", "b"])
    w.add_array("nested", [[1, 2], [3]])
    w.add_tensor("a", np.ones((3, 32), np.float32))
    q = np.zeros((2, 144), np.uint8)  # two Q4_K blocks (gguf-py can dequantize Q4_K, not quantize it)
    w.add_tensor("b", q, raw_shape=q.shape, raw_dtype=T.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    validate_gguf(path)


def _with(**changes):
    def make():
        p = valid_parts()
        p.update(changes)
        return p
    return make


def _kv_case(*extra_kvs):
    def make():
        p = valid_parts()
        p["kvs"] = p["kvs"] + list(extra_kvs)
        return p
    return make


def _info_case(index, info):
    def make():
        p = valid_parts()
        p["infos"] = list(p["infos"])
        p["infos"][index] = info
        return p
    return make


def _truncated():
    return build(valid_parts())[:-20]


def _huge_key():
    p = valid_parts()
    p["kvs"] = [struct.pack("<Q", 2 ** 62) + b"abc"] + p["kvs"][1:]
    return p


BIG = 2 ** 60
CASES = {
    "shorter than a header": (lambda: b"GGUF\x03\x00", "shorter than a GGUF header"),
    "bad magic": (_with(magic=b"GGML"), "not a GGUF file"),
    "version 1": (_with(version=1), "GGUF version 1 is not supported"),
    "version 4": (_with(version=4), "GGUF version 4 is not supported"),
    "tensor count past the file": (_with(n_tensors=BIG), f"tensor count {BIG} is larger than"),
    "metadata count past the file": (_with(n_kv=BIG), f"metadata count {BIG} is larger than"),
    "metadata count one too many": (_with(n_kv=5, infos=[], data=b"", alignment=1),
                                    "metadata key length needs 8 bytes but only 0 remain"),
    "key length past the file": (_huge_key, "metadata key"),
    "key not UTF-8": (_kv_case(kv(b"bad\xff\xfe", V.UINT8, b"\0")), "metadata key is not UTF-8"),
    "duplicate key": (_kv_case(kv("llama.block_count", V.UINT32, struct.pack("<I", 2))),
                      "duplicate metadata key 'llama.block_count'"),
    "unknown value type": (_kv_case(kv("x", 13, b"\0" * 8)), "metadata 'x': unknown value type 13"),
    "unknown array item type": (_kv_case(kv("x", V.ARRAY, struct.pack("<IQ", 77, 1) + b"\0" * 8)),
                                "unknown array item type 77"),
    "scalar array longer than the file": (_kv_case(kv("x", V.ARRAY, struct.pack("<IQ", V.UINT64, BIG))),
                                          f"array 'x' of {BIG} items"),
    "string array longer than the file": (_kv_case(kv("x", V.ARRAY, struct.pack("<IQ", V.STRING, BIG))),
                                          f"claims {BIG} items"),
    "string value longer than the file": (_kv_case(kv("x", V.STRING, struct.pack("<Q", BIG))),
                                          "string value of 'x'"),
    "arrays nested too deep": (_kv_case(kv("x", V.ARRAY, struct.pack("<IQ", V.ARRAY, 1) * 6
                                           + struct.pack("<IQ", V.UINT8, 0))), "nested deeper than"),
    "alignment zero": (_kv_case(kv("general.alignment", V.UINT32, struct.pack("<I", 0))),
                       "general.alignment must be a nonzero power of two, got 0"),
    "alignment not a power of two": (_kv_case(kv("general.alignment", V.UINT32, struct.pack("<I", 48))),
                                     "nonzero power of two, got 48"),
    "alignment wrong type": (_kv_case(kv("general.alignment", V.UINT64, struct.pack("<Q", 32))),
                             "general.alignment must be a uint32"),
    "n_dims zero": (_info_case(0, gstr("t0") + struct.pack("<IIQ", 0, T.F32, 0)), "n_dims is 0, expected 1..4"),
    "n_dims five": (_info_case(0, tensor_info("t0", [8, 1, 1, 1, 1], T.F32, 0)), "n_dims is 5"),
    "dimension zero": (_info_case(0, tensor_info("t0", [8, 0], T.F32, 0)), "must all be > 0"),
    "dimensions overflow": (_info_case(0, tensor_info("t0", [2 ** 32, 2 ** 32], T.F32, 0)),
                            "overflow a 64-bit element count"),
    "unknown tensor type": (_info_case(0, tensor_info("t0", [8], 4, 0)), "tensor 't0': unknown ggml type 4"),
    "type not dequantizable": (_info_case(2, tensor_info("t2", [256], T.Q8_K, 160)),
                               "tensor 't2': type Q8_K cannot be dequantized"),
    "row not a whole block": (_info_case(2, tensor_info("t2", [16, 2], T.Q8_0, 160)),
                              "row length 16 is not a multiple of Q8_0's block size 32"),
    "offset misaligned": (_info_case(1, tensor_info("t1", [32, 2], T.F16, 40)),
                          "offset 40 is not a multiple of the alignment 32"),
    "offset past the file": (_info_case(1, tensor_info("t1", [32, 2], T.F16, 2 ** 40)), "run past the end"),
    "data size past the file": (_info_case(1, tensor_info("t1", [32, 2 ** 20], T.F16, 32)), "run past the end"),
    "overlapping tensors": (_info_case(1, tensor_info("t1", [8], T.F32, 0)), "overlaps the previous tensor"),
    "duplicate tensor name": (_info_case(1, tensor_info("t0", [32, 2], T.F16, 32)), "duplicate tensor name 't0'"),
    "tensor name not UTF-8": (_info_case(1, tensor_info(b"\xc3(", [32, 2], T.F16, 32)), "tensor name is not UTF-8"),
    "truncated download": (_truncated, "truncated download?"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_validate_gguf_rejects(tmp_path, case):
    make, expected = CASES[case]
    path = write(tmp_path, make())
    with pytest.raises(CheckpointError) as info:
        validate_gguf(path)
    msg = str(info.value)
    assert str(path) in msg and expected in msg and "\n" not in msg, msg


def test_not_found_and_directory(tmp_path):
    with pytest.raises(CheckpointError, match="file not found"):
        validate_gguf(tmp_path / "none.gguf")
    with pytest.raises(CheckpointError, match="is a directory"):
        validate_gguf(tmp_path)


@pytest.mark.parametrize("case", ["string array longer than the file", "key length past the file",
                                  "tensor count past the file", "scalar array longer than the file"])
def test_huge_counts_allocate_nothing(tmp_path, case):
    path = write(tmp_path, CASES[case][0]())
    tracemalloc.start()
    with pytest.raises(CheckpointError):
        validate_gguf(path)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 1024 * 1024, peak


def test_big_endian_file_is_refused(tmp_path):
    """GGUFReader opens a big-endian file, but gguf.quants.dequantize hands its weights back byte-swapped (checked
    here, so the refusal stays justified): refuse instead of computing with them."""
    path = tmp_path / "be.gguf"
    w = gguf.GGUFWriter(path, "llama", endianess=gguf.GGUFEndian.BIG)
    w.add_block_count(1)
    w.add_tensor("a", np.ones((2, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tensor = gguf.GGUFReader(path).tensors[0]
    assert not np.array_equal(gguf.quants.dequantize(tensor.data, tensor.tensor_type), np.ones((2, 32), np.float32))
    with pytest.raises(CheckpointError, match="big-endian GGUF"):
        validate_gguf(path)
    assert_clean_error(run_cli(generate_args(path)), "be.gguf", "big-endian")


# ---- through the CLI ----
CLI_CASES = ["bad magic", "version 1", "tensor count past the file", "string array longer than the file",
             "alignment not a power of two", "type not dequantizable", "truncated download", "dimensions overflow"]


@pytest.mark.parametrize("case", CLI_CASES)
def test_cli_reports_bad_gguf(tmp_path, case):
    make, expected = CASES[case]
    path = write(tmp_path, make())
    assert_clean_error(run_cli(generate_args(path)), "bad.gguf", expected)
