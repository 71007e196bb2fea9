"""A validating safetensors reader/writer on NumPy alone.

Why not `safetensors.numpy`: NumPy has no bfloat16, so the library cannot hand Llama's bf16 weights to NumPy
without torch. This reader validates the whole header before touching data (a stranger's file must fail with a
clear message, never an out-of-range read or a huge allocation), memory-maps fp32 tensors, and widens
bf16/fp16 to fp32 one tensor at a time so peak memory stays near the fp32 model size.

Format: 8-byte little-endian header length N, N bytes of UTF-8 JSON {name: {dtype, shape, data_offsets}},
then the data section; offsets are relative to its start and must tile it exactly.
"""
from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from refimpl.errors import CheckpointError, quote
from refimpl.formats.jsonfile import no_duplicate_keys
from refimpl.formats.safe_open import open_regular

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the format's own limit

_DTYPES = {  # safetensors dtype -> (NumPy storage dtype, bytes per element)
    "F64": (np.float64, 8), "F32": (np.float32, 4), "F16": (np.float16, 2), "BF16": (np.uint16, 2),
    "I64": (np.int64, 8), "I32": (np.int32, 4), "I16": (np.int16, 2), "I8": (np.int8, 1),
    "U64": (np.uint64, 8), "U32": (np.uint32, 4), "U16": (np.uint16, 2), "U8": (np.uint8, 1),
    "BOOL": (np.bool_, 1),
}
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")  # what a weight may be stored as; integers would be quantized codes
_KNOWN_UNSUPPORTED = {"F8_E4M3", "F8_E5M2", "F8_E8M0", "F4", "F6_E2M3", "F6_E3M2", "C64"}


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute file offsets
    end: int


class SafetensorsFile:
    """Header parsed and validated on open; tensors read on demand with `load(name)`."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        with open_regular(self.path, "expected a .safetensors file") as f:
            size = os.fstat(f.fileno()).st_size
            try:
                head = f.read(8)
                if len(head) < 8:
                    raise self._error(f"file is {size} bytes, shorter than the 8-byte header length")
                (n,) = struct.unpack("<Q", head)
                if n > MAX_HEADER_BYTES:
                    raise self._error(f"header length {n} exceeds the format's 100 MB limit")
                if n > size - 8:
                    raise self._error(f"header length {n} runs past the end of the {size}-byte file "
                                      f"(truncated download?)")
                raw = f.read(n)
            except OSError as e:  # an I/O error: still the user's file, still one line
                raise CheckpointError(f"{self.path}: cannot read ({e.strerror or e})") from None
        try:
            header = json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicate_keys)
        except UnicodeDecodeError:
            raise self._error("header is not UTF-8") from None
        except ValueError as e:  # JSONDecodeError is a ValueError; so is our duplicate-key error
            raise self._error(f"header is not valid JSON ({e})") from None
        except RecursionError:  # e.g. 10^5 nested brackets: legal JSON, never a safetensors header
            raise self._error("header JSON is nested too deeply") from None
        if not isinstance(header, dict):
            raise self._error("header is not a JSON object")
        self.metadata = header.pop("__metadata__", None) or {}
        if not isinstance(self.metadata, dict) or not all(isinstance(v, str) for v in self.metadata.values()):
            raise self._error("__metadata__ must map strings to strings")
        self.tensors = self._validate(header, data_start=8 + n, data_len=size - 8 - n)

    def _error(self, msg: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: {msg}")

    def _validate(self, header: dict, data_start: int, data_len: int) -> dict[str, TensorInfo]:
        infos, spans = {}, []
        for name, entry in header.items():
            where = f"tensor {quote(name)}"
            if not isinstance(entry, dict) or set(entry) - {"dtype", "shape", "data_offsets"} or len(entry) != 3:
                raise self._error(f"{where}: expected exactly dtype, shape and data_offsets")
            dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
            if not isinstance(dtype, str) or dtype not in _DTYPES:
                hint = " (not supported here)" if isinstance(dtype, str) and dtype in _KNOWN_UNSUPPORTED else ""
                raise self._error(f"{where}: unknown dtype {dtype!r}{hint}; expected one of "
                                  f"{', '.join(_DTYPES)}")
            if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                      for d in shape):
                raise self._error(f"{where}: shape must be a list of non-negative integers, got {shape!r}")
            if (not isinstance(offsets, list) or len(offsets) != 2 or
                    not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
                raise self._error(f"{where}: data_offsets must be [begin, end] integers, got {offsets!r}")
            begin, end = offsets
            if not 0 <= begin <= end <= data_len:
                hint = " (truncated download?)" if 0 <= begin <= end else ""
                raise self._error(f"{where}: data_offsets {offsets} out of range of the {data_len}-byte "
                                  f"data section{hint}")
            expected = math.prod(shape) * _DTYPES[dtype][1]
            if end - begin != expected:
                raise self._error(f"{where}: holds {end - begin} bytes but shape {shape} × {dtype} needs "
                                  f"{expected}")
            infos[name] = TensorInfo(dtype, tuple(shape), data_start + begin, data_start + end)
            spans.append((begin, end, name))
        cursor = 0
        for begin, end, name in sorted(spans):
            if begin < cursor:
                raise self._error(f"tensor {name!r}: data_offsets overlap the previous tensor")
            if begin > cursor:
                raise self._error(f"tensor {name!r}: gap of {begin - cursor} bytes before its data")
            cursor = end
        if cursor != data_len:
            raise self._error(f"{data_len - cursor} trailing bytes after the last tensor")
        return infos

    def names(self) -> list[str]:
        return list(self.tensors)

    def load_weight(self, name: str) -> np.ndarray:
        """A model weight as float32; integer or boolean storage (quantized codes, masks) is refused, not cast."""
        dtype = self.tensors[name].dtype
        if dtype not in FLOAT_DTYPES:
            raise self._error(f"tensor {quote(name)} is stored as {dtype}; a weight must be one of "
                              f"{', '.join(FLOAT_DTYPES)} (a quantized checkpoint needs its own loader)")
        return self.load(name)

    def load(self, name: str) -> np.ndarray:
        """The tensor widened to float32 (floating dtypes) or in its own integer dtype."""
        info = self.tensors[name]
        storage, _ = _DTYPES[info.dtype]
        count = math.prod(info.shape)
        if info.dtype == "F32":
            if count == 0:
                return np.zeros(info.shape, np.float32)
            # zero-copy: pages are read when touched
            return np.memmap(self.path, np.float32, mode="r", offset=info.begin, shape=info.shape)
        with open_regular(self.path) as f:
            f.seek(info.begin)
            raw = np.fromfile(f, storage, count=count)
        if raw.size != count:
            raise self._error(f"tensor {quote(name)}: file ended early (truncated download?)")
        raw = raw.reshape(info.shape)
        if info.dtype == "BF16":
            return bf16_to_f32(raw)
        if info.dtype in ("F16", "F64"):
            return raw.astype(np.float32)
        return raw

    def load_slice(self, name: str, dim: int, start: int, stop: int, chunk_bytes: int = 16 << 20) -> np.ndarray:
        """Indices start..stop-1 along `dim` (0: rows, 1: columns) of a 2-D float weight, as float32, reading only
        those bytes: one read for rows; for columns, blocks of whole rows of at most `chunk_bytes`, each cut to the
        columns (tensor-parallel loading: no rank holds more than its slice and one block)."""
        info = self.tensors[name]
        if info.dtype not in FLOAT_DTYPES or len(info.shape) != 2 or not 0 <= start <= stop <= info.shape[dim]:
            raise self._error(f"tensor {quote(name)} ({info.dtype} {list(info.shape)}): cannot take [{start}, "
                              f"{stop}) along dim {dim}")
        rows, cols = info.shape
        size = _DTYPES[info.dtype][1]
        if dim == 0:
            return self._read_rows(name, start, stop)
        out = np.empty((rows, stop - start), np.float32)
        step = max(1, chunk_bytes // max(1, cols * size))
        for r in range(0, rows, step):
            out[r:r + step] = self._read_rows(name, r, min(r + step, rows))[:, start:stop]
        return out

    def _read_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows start..stop-1 of a 2-D float tensor, read (not mapped) and widened to float32."""
        info = self.tensors[name]
        storage, size = _DTYPES[info.dtype]
        cols = info.shape[1]
        with open_regular(self.path) as f:
            f.seek(info.begin + start * cols * size)
            raw = np.fromfile(f, storage, count=(stop - start) * cols)
        if raw.size != (stop - start) * cols:
            raise self._error(f"tensor {quote(name)}: file ended early (truncated download?)")
        raw = raw.reshape(stop - start, cols)
        return bf16_to_f32(raw) if info.dtype == "BF16" else raw.astype(np.float32, copy=False)


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """bf16 is the top half of an fp32: widen by shifting the 16 bits into place (exact)."""
    out = np.empty(bits.shape, np.float32)
    out.view(np.uint32)[...] = bits.astype(np.uint32) << 16
    return out


def round_bf16(x: np.ndarray) -> np.ndarray:
    """fp32 -> the nearest bf16 value (ties to even) as fp32, as torch's .to(torch.bfloat16) rounds finite values."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return rounded.view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even fp32 -> bf16 bits (uint16): the top half of round_bf16's fp32."""
    return (round_bf16(x).view(np.uint32) >> np.uint32(16)).astype(np.uint16)


def save_safetensors(path: str | Path, tensors: dict[str, np.ndarray], dtype: str = "F32",
                     metadata: dict[str, str] | None = None, dtype_of: dict[str, str] | None = None) -> None:
    """Write float tensors as `dtype` (F32, F16 or BF16), or as dtype_of[name] where given; integer arrays keep
    their own dtype."""
    header, blobs, offset = {}, [], 0
    for name, array in tensors.items():
        array = np.asarray(array)
        if np.issubdtype(array.dtype, np.floating):
            tag = (dtype_of or {}).get(name, dtype)
            data = f32_to_bf16(array) if tag == "BF16" else array.astype({"F32": np.float32,
                                                                          "F16": np.float16}[tag])
        else:
            tag = next(k for k, (t, _) in _DTYPES.items() if np.dtype(t) == array.dtype and k != "BF16")
            data = array
        blob = np.ascontiguousarray(data).tobytes()
        header[name] = {"dtype": tag, "shape": list(array.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    if metadata:
        header["__metadata__"] = metadata
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # align the data section to 8 bytes, as the reference writer does
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for blob in blobs:
            f.write(blob)
