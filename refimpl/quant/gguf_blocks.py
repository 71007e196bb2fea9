"""GGUF's 32-element blocks, read as llama.cpp's ggml-common.h defines them (little-endian, one row = K/32 blocks):

    Q8_0  34 bytes: d fp16, qs int8[32]              w[i] = d · qs[i]
    Q4_0  18 bytes: d fp16, qs uint8[16]             w[i] = d · (nibble(i) − 8)
    Q4_1  20 bytes: d fp16, m fp16, qs uint8[16]     w[i] = d · nibble(i) + m
    nibble(i) = qs[i] & 0xF for i < 16, qs[i − 16] >> 4 for i >= 16 (the block's first half in the low nibbles).

Every product is computed in fp32 from the fp16 fields (d · q is exact there: 11 × 8 significant bits).
"""
from __future__ import annotations

import numpy as np

from refimpl.quant.formats import F32, QuantError

BLOCK = 32
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20}


def _blocks(fmt: str, data: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """uint8 [N, K/32 · B] -> [N, K/32, B]."""
    N, K = shape
    if K % BLOCK or data.shape != (N, K // BLOCK * BLOCK_BYTES[fmt]):
        raise QuantError(f"{fmt} data of shape {list(data.shape)} does not hold a [{N}, {K}] matrix in blocks of "
                         f"{BLOCK} ({BLOCK_BYTES[fmt]} bytes each)")
    return data.reshape(N, K // BLOCK, BLOCK_BYTES[fmt])


def _fp16(field: np.ndarray) -> np.ndarray:
    """[..., 2] little-endian bytes -> [..., 1] fp32."""
    return np.ascontiguousarray(field).view("<f2").astype(F32)


def nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] codes 0..15: the low nibbles are elements 0..15, the high ones 16..31."""
    return np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=-1)


def block_fields(fmt: str, data: np.ndarray, shape: tuple[int, int]):
    """-> (d [N, K/32, 1], m [N, K/32, 1] or None, codes [N, K/32, 32]): int8 for Q8_0, uint8 0..15 for Q4."""
    b = _blocks(fmt, data, shape)  # [N, K/32, B]
    d = _fp16(b[..., 0:2])
    if fmt == "q8_0":
        return d, None, np.ascontiguousarray(b[..., 2:]).view(np.int8)
    if fmt == "q4_0":
        return d, None, nibbles(b[..., 2:])
    return d, _fp16(b[..., 2:4]), nibbles(b[..., 4:])


def dequantize_blocks(fmt: str, data: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """-> fp32 [N, K]."""
    d, m, q = block_fields(fmt, data, shape)  # [N, K/32, 1], ..., [N, K/32, 32]
    if fmt == "q8_0":
        w = d * q.astype(F32)
    elif fmt == "q4_0":
        w = d * (q.astype(F32) - F32(8))
    else:
        w = d * q.astype(F32) + m
    return w.reshape(shape)  # [N, K/32, 32] -> [N, K]
