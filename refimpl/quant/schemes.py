"""Weight-only quantization formats, the oracle: quantize, pack and dequantize, exactly and in small steps.

A quantized matrix W [N, K] (the checkpoint's [Dout, Din]) is a `QuantizedLinear`; the refimpl runs it by
`dequantize()` then the fp32 product, so the engines compare op by op on the same dequantized values.

    int8   per output row, symmetric:   s[n] = bf16(max_k |W[n, k]| / 127)
                                        q[n, k] = clip(rint(W[n, k] / s[n]), -127, 127)          int8 [N, K]
                                        W ≈ q · s
    int4   per group of G along K, asymmetric (scale and minimum, as GGUF's Q4_1):
                                        s[n, g] = bf16((max − min) / 15),  m[n, g] = bf16(min)   over the group
                                        q[n, k] = clip(rint((W[n, k] − m) / s), 0, 15)
                                        W ≈ q · s + m
           packed two a byte along K: byte j of a row = q[2j] | q[2j+1] << 4 (low nibble first)   uint8 [N, K/2]

Asymmetric int4 because weight groups are rarely centred on 0: the 16 levels span [min, max] exactly instead of
±max|w| (15 of 16 levels with a symmetric code), about half the rounding error for one more bf16 per group.
Scales and minima are always rounded to bf16 (round half to even), whatever dtype the engine computes in: the
quantized weights are then the same bits in the fp32 refimpl and in a bf16 or fp32 accel engine. The divisions are
fp32 with the rounded scale, rint is round half to even; a zero scale (a constant group) gives q = 0.
The last group of a row may be shorter than G (SmolLM2's K = 576 with G = 128): its min/max are over its own values.

GGUF blocks (`q8_0`, `q4_0`, `q4_1`) are kept as the file stores them; refimpl.quant.gguf_blocks reads them.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import numpy as np

from refimpl.errors import Llama32Error, QuantError
from refimpl.formats.safetensors_io import round_bf16
from refimpl.quant.gguf_blocks import dequantize_blocks

F32 = np.float32
INT_FORMATS = ("int8", "int4")
GGUF_FORMATS = ("q8_0", "q4_0", "q4_1")
INT4_GROUPS = (32, 64, 128)


@dataclass(frozen=True, eq=False)
class QuantizedLinear:
    """One quantized weight matrix [N, K] = [Dout, Din].

    format  'int8' | 'int4' | 'q8_0' | 'q4_0' | 'q4_1'
    data    int8 [N, K] (int8) | uint8 [N, K/2] nibbles (int4) | uint8 [N, K/32 · bytes a block] (GGUF blocks)
    scales  fp32 holding bf16 values: [N, 1] (int8), [N, ceil(K/G)] (int4); None for GGUF (inside the blocks)
    mins    int4: [N, ceil(K/G)], like scales; else None
    group   elements sharing one scale along K: K (int8), G (int4), 32 (GGUF)
    """

    format: str
    shape: tuple[int, int]
    data: np.ndarray
    scales: np.ndarray | None
    mins: np.ndarray | None
    group: int

    def dequantize(self) -> np.ndarray:
        """-> fp32 [N, K], the values every engine must multiply by."""
        if self.format == "int8":
            return dequantize_int8(self.data, self.scales)
        if self.format == "int4":
            return dequantize_int4(self.data, self.scales, self.mins, self.group)
        return dequantize_blocks(self.format, self.data, self.shape)

    @functools.cached_property
    def values(self) -> np.ndarray:
        """`dequantize()` computed once, on first use (the refimpl's forward multiplies by it every call)."""
        return self.dequantize()

    def take_rows(self, order: np.ndarray) -> "QuantizedLinear":
        """The rows in `order` (a row permutation is exact on any format: blocks never cross rows)."""
        pick = lambda a: None if a is None else np.ascontiguousarray(a[order])  # noqa: E731
        return QuantizedLinear(self.format, (len(order), self.shape[1]), pick(self.data), pick(self.scales),
                               pick(self.mins), self.group)

    @property
    def nbytes(self) -> int:
        """Bytes as an engine stores them: codes plus bf16 scales/minima (GGUF: the blocks)."""
        extra = sum(a.size * 2 for a in (self.scales, self.mins) if a is not None)
        return self.data.nbytes + extra


def _divide_or_zero(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """num / den in fp32, 0 where den is 0 (a constant row or group)."""
    safe = np.where(den == 0, F32(1), den)
    return np.where(den == 0, F32(0), num / safe).astype(F32)


# ---------------------------------------------------------------- int8, per output row

def quantize_int8(w: np.ndarray) -> QuantizedLinear:
    w = np.asarray(w, F32)  # [N, K]
    scale = round_bf16(np.abs(w).max(axis=1, keepdims=True) / F32(127))  # [N, 1]
    return QuantizedLinear("int8", w.shape, int8_codes(w, scale), scale, None, w.shape[1])


def int8_codes(w: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The nearest codes for a given scale: w [..., K], scale [..., 1] (bf16 values) -> int8 [..., K]."""
    return np.clip(np.rint(_divide_or_zero(w, scale)), -127, 127).astype(np.int8)


def dequantize_int8(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    return q.astype(F32) * scale  # [N, K] * [N, 1] -> [N, K]


# ---------------------------------------------------------------- int4, groups of G along K

def pack_nibbles(q: np.ndarray) -> np.ndarray:
    """uint8 codes 0..15 [N, K] (K even) -> [N, K/2]: byte j = q[2j] | q[2j+1] << 4."""
    pairs = q.reshape(q.shape[0], -1, 2)  # [N, K] -> [N, K/2, 2]
    return (pairs[..., 0] | (pairs[..., 1] << np.uint8(4))).astype(np.uint8)


def unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    """[N, K/2] -> uint8 codes [N, K] (low nibble first)."""
    pairs = np.stack([packed & np.uint8(0x0F), packed >> np.uint8(4)], axis=-1)  # [N, K/2, 2]
    return pairs.reshape(packed.shape[0], -1)  # -> [N, K]


def int4_groups(w: np.ndarray, G: int) -> np.ndarray:
    """[N, K] -> [N, ceil(K/G), G]; a short last group is padded with its own last value (min/max unchanged)."""
    N, K = w.shape
    pad = -K % G
    return np.pad(w, ((0, 0), (0, pad)), mode="edge").reshape(N, -1, G)


def quantize_int4(w: np.ndarray, group: int) -> QuantizedLinear:
    w = np.asarray(w, F32)  # [N, K]
    N, K = w.shape
    if K % 2:
        raise QuantError(f"int4 packs two values a byte: the input dimension must be even, got {K}")
    g = int4_groups(w, group)  # [N, ceil(K/G), G]
    lo, hi = g.min(axis=2), g.max(axis=2)  # [N, ceil(K/G)] each
    return int4_linear(w, round_bf16((hi - lo) / F32(15)), round_bf16(lo), group)


def int4_codes(g: np.ndarray, scale: np.ndarray, low: np.ndarray) -> np.ndarray:
    """The nearest codes for a given scale and minimum: g [..., G], scale and low [...] (bf16 values)
    -> uint8 [..., G] in 0..15."""
    return np.clip(np.rint(_divide_or_zero(g - low[..., None], scale[..., None])), 0, 15).astype(np.uint8)


def int4_linear(w: np.ndarray, scale: np.ndarray, low: np.ndarray, group: int) -> QuantizedLinear:
    """w [N, K] quantized with given bf16 scales and minima [N, ceil(K/G)] (its codes the nearest ones)."""
    N, K = w.shape
    q = int4_codes(int4_groups(w, group), scale, low).reshape(N, -1)[:, :K]  # [N, ceil(K/G), G] -> [N, K]
    return QuantizedLinear("int4", (N, K), pack_nibbles(q), scale, low, group)


def dequantize_int4(packed: np.ndarray, scale: np.ndarray, low: np.ndarray, group: int) -> np.ndarray:
    q = unpack_nibbles(packed).astype(F32)  # [N, K]
    per_col = np.arange(q.shape[1]) // group  # [K]: each column's group
    return q * scale[:, per_col] + low[:, per_col]  # [N, K]


# ---------------------------------------------------------------- which format

# What `int4:G:mixed` quantizes to int8, after llama.cpp's Q4_K_M (more bits for output.weight, attn_v and
# ffn_down): v widened to its fused q/k/v group, since accel multiplies q/k/v in one GEMV of one format.
MIXED_INT8 = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.down_proj", "lm_head")
MATRIX_KEYS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj", "lm_head")
FUSED_GROUPS = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj"))


def int8_keys_of(keys, what: str, error: type[Llama32Error] = QuantError) -> tuple[str, ...]:
    """A list of matrix names to make int8 -> the tuple in MATRIX_KEYS order, or `error` naming `what`: every item a
    MATRIX_KEYS string, each fused group (accel runs it as one matrix of one format) listed whole or not at all."""
    if not isinstance(keys, (list, tuple)) or not all(isinstance(k, str) and k in MATRIX_KEYS for k in keys):
        raise error(f"{what} {keys!r}: expected a list of matrix names drawn from {list(MATRIX_KEYS)}")
    for group in FUSED_GROUPS:
        if 0 < len(set(group) & set(keys)) < len(group):
            raise error(f"{what} {keys!r}: {' / '.join(group)} run as one fused matrix of one format: list all "
                        f"{len(group)} or none")
    return tuple(k for k in MATRIX_KEYS if k in keys)


@dataclass(frozen=True)
class QuantSpec:
    """`--quant` parsed: 'int8', 'int4' (G = 64), 'int4:G', 'int4:G:mixed' (int4 with the MIXED_INT8 matrices of
    every layer, and the lm_head, in int8), 'int4:G:mixed(KEY+KEY...)' (those MATRIX_KEYS in int8 instead), or
    'gguf' (keep the file's Q8_0/Q4_0/Q4_1 blocks); a ':bf16-head' suffix leaves the lm_head unquantized.
    int8_keys: the matrices (MATRIX_KEYS) an int4 spec makes int8 instead; a fused group (q/k/v, gate/up) is
    always whole (int8_keys_of refuses a split one: accel would quantize the whole group in one member's format)."""

    format: str
    group: int | None = None
    lm_head: bool = True
    int8_keys: tuple[str, ...] = ()

    @classmethod
    def parse(cls, text: str) -> "QuantSpec":
        parts = text.strip().lower().split(":")
        head = parts[-1] != "bf16-head"
        parts = parts if head else parts[:-1]
        mixed = len(parts) > 1 and re.fullmatch(r"mixed(?:\((.*)\))?", parts[-1])
        parts = parts[:-1] if mixed else parts
        fmt, rest = parts[0], parts[1:]
        usage = ("expected int8, int4, int4:32, int4:64, int4:128 or gguf, int4 optionally followed by :mixed or "
                 ":mixed(KEY+KEY...), then optionally :bf16-head")
        if fmt not in ("int8", "int4", "gguf") or len(rest) > (fmt == "int4") or (mixed and fmt != "int4"):
            raise QuantError(f"--quant {text!r}: {usage}")
        group = None
        if fmt == "int4":
            group = int(rest[0]) if rest and rest[0].isdigit() else 64 if not rest else None
            if group not in INT4_GROUPS:
                raise QuantError(f"--quant {text!r}: the int4 group must be one of {INT4_GROUPS}")
        if mixed and mixed[1] is not None:
            return cls(fmt, group, head, int8_keys_of([k.strip() for k in mixed[1].split("+")], f"--quant {text!r}:"))
        return cls(fmt, group, head, MIXED_INT8 if mixed else ())

    def __str__(self) -> str:
        base = f"int4:{self.group}" if self.format == "int4" else self.format
        if self.int8_keys:
            base += ":mixed" if self.int8_keys == MIXED_INT8 else f":mixed({'+'.join(self.int8_keys)})"
        return base if self.lm_head else base + ":bf16-head"

    def for_matrix(self, name: str) -> "QuantSpec":
        """The one-format spec of the matrix `name` (`model.layers.3.mlp.down_proj.weight`, `lm_head.weight`)."""
        if self.int8_keys and name.removesuffix(".weight").split(".", 3)[-1] in self.int8_keys:
            return QuantSpec("int8", None, self.lm_head)
        return QuantSpec(self.format, self.group, self.lm_head) if self.int8_keys else self

    def quantize(self, w: np.ndarray) -> QuantizedLinear:
        """Round to nearest in this (one-format) spec."""
        return quantize_int8(w) if self.format == "int8" else quantize_int4(w, self.group)
