"""GGUF's 32-element blocks, read as llama.cpp's ggml-common.h defines them (little-endian, one row = K/32 blocks):

    Q8_0  34 bytes: d fp16, qs int8[32]              w[i] = d · qs[i]
    Q4_0  18 bytes: d fp16, qs uint8[16]             w[i] = d · (nibble(i) − 8)
    Q4_1  20 bytes: d fp16, m fp16, qs uint8[16]     w[i] = d · nibble(i) + m
    nibble(i) = qs[i] & 0xF for i < 16, qs[i − 16] >> 4 for i >= 16 (the block's first half in the low nibbles).

Every product is computed in fp32 from the fp16 fields (d · q is exact there: 11 × 8 significant bits), so the
values are gguf.quants.dequantize's bit for bit. The one decoder of these blocks: the GGUF loader dequantizes
whole files with it, the quantized engines read kept blocks with it. A tensor is done a few thousand blocks at a
time, writing straight into the output with the widening inside the multiply, so the temporaries stay in the CPU's
cache (gguf's whole-tensor temporaries are six passes over hundreds of MB: most of a Q4 model's loading time).
"""
from __future__ import annotations

import numpy as np

from refimpl.errors import QuantError

F32 = np.float32

BLOCK = 32
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20}
GGML_TYPES = {8: "q8_0", 2: "q4_0", 3: "q4_1"}  # ggml's type codes
CHUNK_BLOCKS = 16384  # 512K values a chunk: a 2 MB output slice and its temporaries fit in L2


def _blocks(fmt: str, data: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """uint8 [N, K/32 · B] -> [N, K/32, B]."""
    N, K = shape
    if K % BLOCK or data.shape != (N, K // BLOCK * BLOCK_BYTES[fmt]):
        raise QuantError(f"{fmt} data of shape {list(data.shape)} does not hold a [{N}, {K}] matrix in blocks of "
                         f"{BLOCK} ({BLOCK_BYTES[fmt]} bytes each)")
    return data.reshape(N, K // BLOCK, BLOCK_BYTES[fmt])


def _fp16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The little-endian fp16 at byte `at` of every block: [..., B] -> [..., 1] fp32."""
    return np.ascontiguousarray(blocks[..., at:at + 2]).view("<f2").astype(F32)


def nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] codes 0..15: the low nibbles are elements 0..15, the high ones 16..31 (one
    contiguous row per block, so the scale multiply runs over whole rows, not over two strided halves)."""
    q = np.empty((*qs.shape[:-1], BLOCK), np.uint8)
    np.bitwise_and(qs, 0x0F, out=q[..., :16])
    np.right_shift(qs, 4, out=q[..., 16:])
    return q


def block_fields(fmt: str, data: np.ndarray, shape: tuple[int, int]):
    """-> (d [N, K/32, 1], m [N, K/32, 1] or None, codes [N, K/32, 32]): int8 for Q8_0, uint8 0..15 for Q4."""
    b = _blocks(fmt, data, shape)  # [N, K/32, B]
    d = _fp16(b, 0)
    if fmt == "q8_0":
        return d, None, np.ascontiguousarray(b[..., 2:]).view(np.int8)
    if fmt == "q4_0":
        return d, None, nibbles(b[..., 2:])
    return d, _fp16(b, 2), nibbles(b[..., 4:])


def _decode(fmt: str, b: np.ndarray, out: np.ndarray) -> None:
    """b uint8 [n, B] -> out fp32 [n, 32]."""
    d = _fp16(b, 0)  # [n, 1]
    if fmt == "q8_0":
        np.multiply(b[:, 2:].view(np.int8), d, out=out)  # [n, 32] · [n, 1]
    elif fmt == "q4_0":
        np.multiply(nibbles(b[:, 2:]).view(np.int8) - np.int8(8), d, out=out)  # codes − 8 fit int8
    else:
        np.multiply(nibbles(b[:, 4:]), d, out=out)
        out += _fp16(b, 2)  # + m [n, 1]


def decode(fmt: str, data: np.ndarray) -> np.ndarray:
    """Whole blocks of `fmt`, uint8 [n · B] (any shape) -> fp32 [n, 32], chunk by chunk."""
    b = data.reshape(-1, BLOCK_BYTES[fmt])  # [n, B]
    out = np.empty((b.shape[0], BLOCK), F32)  # [n, 32]
    for i in range(0, b.shape[0], CHUNK_BLOCKS):
        _decode(fmt, b[i:i + CHUNK_BLOCKS], out[i:i + CHUNK_BLOCKS])
    return out


def dequantize_blocks(fmt: str, data: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """uint8 [N, K/32 · B] -> fp32 [N, K]."""
    return decode(fmt, _blocks(fmt, data, shape)).reshape(shape)  # [N · K/32, 32] -> [N, K]


def dequantize_ggml(data: np.ndarray, type_code: int) -> np.ndarray | None:
    """A GGUF tensor's bytes, uint8 [n_bytes] -> fp32 [n_values]; None for a type other than these three."""
    fmt = GGML_TYPES.get(int(type_code))
    return None if fmt is None else decode(fmt, data).reshape(-1)
