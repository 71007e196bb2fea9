"""A bounds-checked walk of a GGUF file's header, run before the gguf library's GGUFReader sees the file.

Why: GGUFReader trusts every count and length it reads. A string length of 2^63 or an array of 10^15 items makes it
slice, loop or allocate without limit, and a bad type code ends in a bare ValueError/KeyError. This walk reads the
same layout with `struct` over a read-only mmap (nothing is copied), checks every count against the bytes that are
left before using it, and raises CheckpointError naming the file, the byte offset and what was expected. A file that
passes is one GGUFReader opens without error and whose tensors the library can dequantize.

Layout (GGUF versions 2 and 3; version 1's 32-bit counts are not accepted):
    magic "GGUF" | u32 version | u64 tensor_count | u64 kv_count
    kv_count × (string key | u32 value_type | value)        string = u64 length + UTF-8 bytes
    tensor_count × (string name | u32 n_dims | n_dims × u64 dim | u32 ggml_type | u64 offset)
    padding to general.alignment (default 32) | data section (tensor offsets are relative to its start)
The byte order is the writer's: a version whose low 16 bits are zero means the file is byte-swapped (as GGUFReader).
"""
from __future__ import annotations

import math
import mmap
import struct
from functools import lru_cache
from pathlib import Path

import numpy as np

from refimpl.errors import CheckpointError

GGML_MAX_DIMS = 4  # ggml.h; gguf-py does not export it
SUPPORTED_VERSIONS = (2, 3)  # gguf-py's READER_SUPPORTED_VERSIONS
MAX_ARRAY_DEPTH = 4  # arrays of arrays are legal; real files nest at most once
_MIN_KV_BYTES = 8 + 4 + 1  # empty key, type code, a 1-byte value: lets us reject a kv_count the file cannot hold
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8  # empty name, n_dims, one dim, type, offset


def _gguf():
    import gguf  # lazily: refimpl needs gguf only for GGUF files
    return gguf


@lru_cache(maxsize=None)
def _scalar_sizes() -> dict[int, int]:
    """GGUF value type code -> byte size, for the fixed-size types (from gguf's own reader table)."""
    gguf = _gguf()
    return {int(t): np.dtype(np_type).itemsize for t, np_type in gguf.GGUFReader.gguf_scalar_to_np.items()}


@lru_cache(maxsize=None)
def can_dequantize(type_code: int) -> bool:
    """True if gguf.quants.dequantize handles this ggml type (asked by dequantizing one zero block)."""
    gguf = _gguf()
    qtype = gguf.GGMLQuantizationType(type_code)
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    try:
        gguf.quants.dequantize(np.zeros(type_size, np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


class _Cursor:
    """Reads little- or big-endian values from a buffer, refusing to step past its end."""

    def __init__(self, buf, path: Path):
        self.buf, self.path, self.pos, self.order = buf, path, 0, "<"

    def error(self, msg: str, at: int | None = None) -> CheckpointError:
        return CheckpointError(f"{self.path}: {msg} (at byte {self.pos if at is None else at})")

    @property
    def left(self) -> int:
        return len(self.buf) - self.pos

    def need(self, n: int, what: str) -> None:
        if n > self.left:
            raise self.error(f"{what} needs {n} bytes but only {self.left} remain (truncated download?)")

    def unpack(self, fmt: str, what: str):
        size = struct.calcsize(fmt)
        self.need(size, what)
        (value,) = struct.unpack_from(self.order + fmt, self.buf, self.pos)
        self.pos += size
        return value

    def u32(self, what: str) -> int:
        return self.unpack("I", what)

    def u64(self, what: str) -> int:
        return self.unpack("Q", what)

    def skip(self, n: int, what: str) -> None:
        self.need(n, what)
        self.pos += n

    def string(self, what: str) -> str:
        start = self.pos
        n = self.u64(f"{what} length")
        self.need(n, f"{what} ({n} bytes)")
        raw = bytes(self.buf[self.pos:self.pos + n])  # bounded by the file's size, checked just above
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.error(f"{what} is not UTF-8", at=start) from None


def _skip_value(cur: _Cursor, type_code: int, key: str, depth: int = 0) -> None:
    """Step over one metadata value of `type_code`, checking sizes before any loop runs."""
    gguf = _gguf()
    scalars = _scalar_sizes()
    if type_code in scalars:
        cur.skip(scalars[type_code], f"value of {key!r}")
    elif type_code == gguf.GGUFValueType.STRING:
        cur.string(f"string value of {key!r}")
    elif type_code == gguf.GGUFValueType.ARRAY:
        if depth >= MAX_ARRAY_DEPTH:
            raise cur.error(f"metadata {key!r}: arrays nested deeper than {MAX_ARRAY_DEPTH}")
        item_type = cur.u32(f"array item type of {key!r}")
        count = cur.u64(f"array length of {key!r}")
        if item_type in scalars:
            cur.skip(count * scalars[item_type], f"array {key!r} of {count} items")
            return
        if item_type not in (gguf.GGUFValueType.STRING, gguf.GGUFValueType.ARRAY):
            raise cur.error(f"metadata {key!r}: unknown array item type {item_type}; expected one of "
                            f"{sorted(int(t) for t in gguf.GGUFValueType)}")
        if count * 8 > cur.left:  # every string or array item starts with an 8-byte length
            raise cur.error(f"array {key!r} claims {count} items but only {cur.left} bytes remain")
        for _ in range(count):
            _skip_value(cur, item_type, key, depth + 1)
    else:
        raise cur.error(f"metadata {key!r}: unknown value type {type_code}; expected one of "
                        f"{sorted(int(t) for t in gguf.GGUFValueType)}")


def _read_alignment(cur: _Cursor, type_code: int, start: int) -> int:
    if type_code != _gguf().GGUFValueType.UINT32:
        raise cur.error(f"general.alignment must be a uint32 (type 4), got type {type_code}", at=start)
    value = cur.u32("general.alignment")
    if value == 0 or value & (value - 1):
        raise cur.error(f"general.alignment must be a nonzero power of two, got {value}", at=start)
    return value


def _first_time(cur: _Cursor, seen: set, name: str, what: str, start: int) -> str:
    """`name`, recorded in `seen`; a second occurrence is an error at `start`."""
    if name in seen:
        raise cur.error(f"duplicate {what} {name!r}", at=start)
    seen.add(name)
    return name


def _read_metadata(cur: _Cursor, kv_count: int) -> int:
    """Walk the key/value section; return the data alignment it sets (32 by default)."""
    gguf = _gguf()
    alignment, keys = gguf.GGUF_DEFAULT_ALIGNMENT, set()
    for _ in range(kv_count):
        start = cur.pos
        key = _first_time(cur, keys, cur.string("metadata key"), "metadata key", start)
        type_code = cur.u32(f"value type of {key!r}")
        if key == "general.alignment":
            alignment = _read_alignment(cur, type_code, start)
        else:
            _skip_value(cur, type_code, key)
    return alignment


def _read_tensor_info(cur: _Cursor, names: set) -> tuple[str, int, int, int]:
    """One tensor info -> (name, ggml type, data bytes, offset in the data section)."""
    gguf = _gguf()
    start = cur.pos
    name = _first_time(cur, names, cur.string("tensor name"), "tensor name", start)
    n_dims = cur.u32(f"tensor {name!r} n_dims")
    if not 1 <= n_dims <= GGML_MAX_DIMS:
        raise cur.error(f"tensor {name!r}: n_dims is {n_dims}, expected 1..{GGML_MAX_DIMS}", at=start)
    dims = [cur.u64(f"tensor {name!r} dimension {i}") for i in range(n_dims)]
    if not all(d > 0 for d in dims):
        raise cur.error(f"tensor {name!r}: dimensions {dims} must all be > 0", at=start)
    n_elems = math.prod(dims)  # Python ints: no overflow here, but ggml stores it in int64
    if n_elems >= 2 ** 63:
        raise cur.error(f"tensor {name!r}: dimensions {dims} overflow a 64-bit element count", at=start)
    type_code = cur.u32(f"tensor {name!r} type")
    known = {int(t): t for t in gguf.GGML_QUANT_SIZES}
    if type_code not in known:
        raise cur.error(f"tensor {name!r}: unknown ggml type {type_code}", at=start)
    qtype = known[type_code]
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if dims[0] % block_size:
        raise cur.error(f"tensor {name!r}: row length {dims[0]} is not a multiple of {qtype.name}'s block size "
                        f"{block_size}", at=start)
    if not can_dequantize(type_code):
        raise cur.error(f"tensor {name!r}: type {qtype.name} cannot be dequantized by the gguf library "
                        f"(re-convert with a float or a common quantized type)", at=start)
    offset = cur.u64(f"tensor {name!r} offset")
    return name, type_code, n_elems // block_size * type_size, offset


def _walk(cur: _Cursor, size: int) -> None:
    if cur.left < 4 or bytes(cur.buf[:4]) != b"GGUF":
        raise cur.error(f"not a GGUF file (expected the magic bytes 'GGUF', got {bytes(cur.buf[:4])!r})", at=0)
    cur.pos = 4
    version = cur.u32("version")
    if version & 0xFFFF == 0:  # written on a machine of the other byte order
        cur.order = ">"
        version = struct.unpack(">I", struct.pack("<I", version))[0]
    if version not in SUPPORTED_VERSIONS:
        raise cur.error(f"GGUF version {version} is not supported (expected 2 or 3)", at=4)
    tensor_count = cur.u64("tensor count")
    kv_count = cur.u64("metadata count")
    if kv_count * _MIN_KV_BYTES > cur.left:
        raise cur.error(f"metadata count {kv_count} is larger than the {size}-byte file could hold", at=16)
    if tensor_count * _MIN_TENSOR_INFO_BYTES > cur.left:
        raise cur.error(f"tensor count {tensor_count} is larger than the {size}-byte file could hold", at=8)
    alignment = _read_metadata(cur, kv_count)
    if tensor_count * _MIN_TENSOR_INFO_BYTES > cur.left:
        raise cur.error(f"tensor count {tensor_count} is larger than the remaining {cur.left} bytes could hold")
    names: set = set()
    infos = [(cur.pos, *_read_tensor_info(cur, names)) for _ in range(tensor_count)]
    data_start = cur.pos + (-cur.pos % alignment)
    spans = []
    for at, name, _, n_bytes, offset in infos:
        if offset % alignment:
            raise cur.error(f"tensor {name!r}: offset {offset} is not a multiple of the alignment {alignment}", at=at)
        if data_start + offset + n_bytes > size:
            raise cur.error(f"tensor {name!r}: its {n_bytes} bytes at data offset {offset} run past the end of the "
                            f"{size}-byte file (truncated download?)", at=at)
        spans.append((offset, offset + n_bytes, name, at))
    end = 0
    for begin, stop, name, at in sorted(spans):
        if begin < end:
            raise cur.error(f"tensor {name!r}: data at offset {begin} overlaps the previous tensor", at=at)
        end = stop


def validate_gguf(path: str | Path) -> None:
    """Raise CheckpointError if `path` is not a GGUF file that gguf.GGUFReader can safely open and dequantize."""
    path = Path(path)
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found") from None
    except IsADirectoryError:
        raise CheckpointError(f"{path}: is a directory, expected a .gguf file") from None
    with f:
        size = path.stat().st_size
        if size < 4 + 4 + 8 + 8:
            raise CheckpointError(f"{path}: file is {size} bytes, shorter than a GGUF header (24 bytes)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            _walk(_Cursor(buf, path), size)
