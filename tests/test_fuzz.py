"""Property: random mutations of a valid safetensors / GGUF file give either a clean Llama32Error or a file that
loads completely. Any other exception (IndexError, ValueError, MemoryError, a hang) is a bug.

For GGUF the property is stronger: a file validate_gguf accepts must open in gguf's GGUFReader and every tensor must
dequantize, i.e. the walk misses nothing the library would trip on.
"""
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from refimpl.errors import Llama32Error
from refimpl.formats.safetensors_io import SafetensorsFile, save_safetensors

gguf = pytest.importorskip("gguf")

from refimpl.formats.gguf_check import validate_gguf  # noqa: E402

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                          HealthCheck.too_slow], derandomize=True)


def valid_safetensors() -> bytes:
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        path = f"{d}/x.safetensors"
        save_safetensors(path, {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(4, np.float32),
                                "c": np.arange(3, dtype=np.int32)}, dtype="BF16", metadata={"format": "pt"})
        return open(path, "rb").read()


def valid_gguf() -> bytes:
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        path = f"{d}/x.gguf"
        w = gguf.GGUFWriter(path, "llama")
        w.add_block_count(1)
        w.add_array("tokenizer.ggml.tokens", ["a", "bc", "d"])
        w.add_array("tokenizer.ggml.scores", [0.5, 1.0, 2.0])
        w.add_tensor("f32", np.arange(64, dtype=np.float32).reshape(2, 32))
        w.add_tensor("f16", np.ones(32, np.float16))
        q8 = gguf.GGMLQuantizationType.Q8_0
        q = gguf.quants.quantize(np.linspace(-1, 1, 64, dtype=np.float32).reshape(2, 32), q8)
        w.add_tensor("q8", q, raw_shape=q.shape, raw_dtype=q8)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return open(path, "rb").read()


SAFETENSORS, GGUF = valid_safetensors(), valid_gguf()


@st.composite
def mutated(draw, original: bytes, header_bytes: int):
    """A few edits: byte flips, truncation, insertions, deletions, and rewrites of little-endian integers (the
    length and count fields), weighted toward the header where the parsing happens."""
    data = bytearray(original)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "truncate", "insert", "delete", "int64", "int32"]))
        limit = max(1, min(len(data), header_bytes))
        at = draw(st.integers(0, limit - 1)) if data else 0
        if kind == "flip" and data:
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "truncate":
            del data[draw(st.integers(0, len(data))):]
        elif kind == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif kind == "delete":
            del data[at:at + draw(st.integers(1, 16))]
        else:
            width = 8 if kind == "int64" else 4
            value = draw(st.one_of(st.integers(0, 64), st.sampled_from([2 ** (8 * width) - 1, 2 ** (8 * width - 1),
                                                                       2 ** 31, 2 ** 40, 10 ** 9])))
            data[at:at + width] = (value % 2 ** (8 * width)).to_bytes(width, "little")
    return bytes(data)


def _must_be_clean(fn):
    try:
        fn()
    except Llama32Error as e:
        assert "\n" not in str(e)


@FUZZ
@given(blob=mutated(SAFETENSORS, header_bytes=8 + int.from_bytes(SAFETENSORS[:8], "little")))
def test_safetensors_mutations(tmp_path, blob):
    path = tmp_path / "m.safetensors"
    path.write_bytes(blob)

    def load_all():
        f = SafetensorsFile(path)
        for name in f.names():
            f.load(name)
    _must_be_clean(load_all)


@FUZZ
@given(blob=mutated(GGUF, header_bytes=len(GGUF) - 64 * 4))
def test_gguf_mutations(tmp_path, blob):
    path = tmp_path / "m.gguf"
    path.write_bytes(blob)
    try:
        validate_gguf(path)
    except Llama32Error as e:
        assert "\n" not in str(e)
        return
    reader = gguf.GGUFReader(path)  # accepted: the library must now read everything without error
    for t in reader.tensors:
        gguf.quants.dequantize(t.data, t.tensor_type)


def _llama_gguf(path):
    """A complete tiny Llama GGUF, written by the GGUF loader's own test helper."""
    from refimpl.formats.params import random_params
    from test_gguf import tiny_config, write_gguf
    cfg = tiny_config()
    return write_gguf(path, cfg, random_params(cfg, seed=0))


def test_gguf_mutations_through_the_loader(tmp_path):
    """Mutations of a real tiny Llama GGUF through refimpl's GGUF loader: only Llama32Error may come out."""
    from refimpl.formats import gguf_loader as loader
    original = _llama_gguf(tmp_path / "llama.gguf").read_bytes()
    loader.load_gguf(tmp_path / "llama.gguf", with_tokenizer=True)  # the unmutated file loads
    header = original.find(b"blk.0.attn_q.weight") + 256  # mutate metadata and tensor infos, not weight bytes
    rng = np.random.default_rng(0)
    path = tmp_path / "m.gguf"
    outcomes = {"error": 0, "loaded": 0}
    for _ in range(150):
        data = bytearray(original)
        for _ in range(rng.integers(1, 4)):
            at = int(rng.integers(0, header))
            if rng.random() < 0.5:
                data[at] ^= 1 << int(rng.integers(0, 8))
            else:
                data[at:at + 8] = struct.pack("<Q", int(rng.choice([0, 1, 7, 2 ** 32, 2 ** 63])))
        path.write_bytes(bytes(data))
        try:
            loader.load_gguf(path, with_tokenizer=True)
            outcomes["loaded"] += 1
        except Llama32Error as e:
            assert "\n" not in str(e)
            outcomes["error"] += 1
    assert outcomes["error"] > 0
