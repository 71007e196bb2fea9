"""Dequantizing llama.cpp's commonest block types quickly: Q4_0, Q4_1, Q8_0 (what small GGUF models ship).

The values are gguf.quants.dequantize's, bit for bit (tests/test_gguf_quants.py holds them to it); only the order
of work differs. gguf builds each tensor from whole-tensor temporaries (split, shift, mask, widen, multiply, add,
concatenate): six passes over hundreds of MB. Here a tensor is done a few thousand blocks at a time, writing
straight into the output with the widening inside the multiply, so the temporaries stay in the CPU's cache
(SmolLM2-135M Q4_1: most of the loading time). Blocks store little-endian fp16 scales, as every GGUF writer does.

    Q4_0  [d fp16 | 16 bytes]         x = (nibble - 8) · d       low nibbles are x[0:16], high nibbles x[16:32]
    Q4_1  [d fp16 | m fp16 | 16 bytes] x = nibble · d + m
    Q8_0  [d fp16 | 32 int8]           x = q · d
"""
from __future__ import annotations

import numpy as np

CHUNK_BLOCKS = 16384  # 512K values a chunk: a 2 MB output slice and its temporaries fit in L2


def _scale(blocks: np.ndarray, at: int) -> np.ndarray:
    """The fp16 at byte `at` of every block -> [n, 1] float32."""
    return blocks[:, at:at + 2].copy().view("<f2").astype(np.float32)  # [n, 2] uint8 -> [n, 1]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 16] bytes -> [n, 32] uint8: the low nibbles, then the high ones (one contiguous row per block, so the
    scale multiply below runs over whole rows, not over two strided halves)."""
    q = np.empty((qs.shape[0], 32), np.uint8)
    np.bitwise_and(qs, 0x0F, out=q[:, :16])
    np.right_shift(qs, 4, out=q[:, 16:])
    return q


def _q4_0(blocks: np.ndarray, out: np.ndarray) -> None:
    d = _scale(blocks, 0)  # [n, 1]
    np.multiply(_nibbles(blocks[:, 2:]).view(np.int8) - np.int8(8), d, out=out)  # [n, 32] · [n, 1]


def _q4_1(blocks: np.ndarray, out: np.ndarray) -> None:
    d, m = _scale(blocks, 0), _scale(blocks, 2)  # [n, 1] each
    np.multiply(_nibbles(blocks[:, 4:]), d, out=out)  # [n, 32] · [n, 1]
    out += m


def _q8_0(blocks: np.ndarray, out: np.ndarray) -> None:
    np.multiply(blocks[:, 2:].view(np.int8), _scale(blocks, 0), out=out)  # [n, 32] · [n, 1]


# ggml type code -> (bytes per block, kernel); each block holds 32 values
_KERNELS = {2: (18, _q4_0), 3: (20, _q4_1), 8: (34, _q8_0)}


def fast_dequantize(data: np.ndarray, type_code: int) -> np.ndarray | None:
    """data: the tensor's bytes, uint8 [n_bytes] -> float32 [n_values]; None for a type handled elsewhere."""
    if int(type_code) not in _KERNELS:
        return None
    block_bytes, kernel = _KERNELS[int(type_code)]
    blocks = data.reshape(-1, block_bytes)  # [n, block bytes]
    out = np.empty((blocks.shape[0], 32), np.float32)  # [n, 32]
    for i in range(0, blocks.shape[0], CHUNK_BLOCKS):
        kernel(blocks[i:i + CHUNK_BLOCKS], out[i:i + CHUNK_BLOCKS])
    return out.reshape(-1)
