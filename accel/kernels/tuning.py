"""Launch configurations of the kernels: plain data, measured on the GPU, read by the launchers.

GEMV      (N, K) of the weight -> GemvConfig (accel/kernels/gemv.py); shapes not listed use `gemv.gemv_config`'s rule.
QKV_ROPE  (N, K) of the fused qkv weight -> QkvConfig (accel/kernels/qkv_rope.py); else `qkv_rope.qkv_config`'s rule.
QGEMV     (N, K, bits, group[, "rope"]) of a quantized weight -> QGemvConfig (accel/kernels/qgemv.py); else its rule.
QGEMV_PDL code width -> PdlMode: how the quantized decode kernels launch on sm_90+ (accel/kernels/qgemv.py, PDL).
MATMUL    (N, K, row bucket) of a batched step's linear layer -> MatmulConfig (accel/kernels/matmul.py); shapes and
          buckets not listed run cuBLAS (accel.ops.paged.batched_linear).
SWIGLU_MATMUL  (2F, K, row bucket) of the fused gate_up weight -> MatmulConfig of the gate_up GEMM with SwiGLU in
          its epilogue (accel.ops.paged.batched_swiglu_linear); not listed: the GEMM as MATMUL says, then SwiGLU.
A `Tuning` bundles one table of each (MATMUL aside: the batched engine reads it as it is) plus the decode
attention's launch options; the engine runs `DEFAULT`.
Below them, the constants the other launchers read as they are (the decode attention's context thresholds and
prefetch, the argmax's block, the prefill dequantize's tile): measured like the tables, not per run.
Benchmarks that try other configs build their own `Tuning` and pass it in: nothing here is rewritten at run time.
The measurements behind the rows (on 132 SMs): docs/performance.md.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Mapping, NamedTuple


class GemvConfig(NamedTuple):
    """kind "persist" / "stream": the persistent / shared-memory-streaming kernel on `programs` programs (None:
    one a row block); kind "split": one [block_n, block_k] tile a program on a (row blocks, K / block_k) grid
    (`programs` unused)."""
    kind: str
    block_n: int
    block_k: int
    warps: int
    programs: int | None = None
    stages: int = 3  # kind "stream": tiles in flight a program


class QkvConfig(NamedTuple):
    half_n: int  # columns of each half-head a program owns (a power of 2)
    warps: int
    stages: int = 0  # > 0: the streaming kernel, with this pipeline depth
    block_k: int = 512  # streaming: K columns a tile
    programs: int | None = None  # streaming: persistent programs (None: one a pair block)


# The fastest config per Llama 3.2 1B / 3B decode shape in the GEMV sweeps (tools.bench.sweeps.gemv, streaming
# kernel included): o, gate_up, down and the lm_head with the final norm folded in.
# The qkv GEMVs are not here: the decode step runs qkv through qkv_rope (QKV_ROPE below).
GEMV: Mapping[tuple[int, int], GemvConfig] = MappingProxyType({
    (2048, 2048): GemvConfig("split", 8, 2048, 8),  # 1B o
    (16384, 2048): GemvConfig("split", 4, 2048, 4),  # 1B gate_up
    (2048, 8192): GemvConfig("stream", 8, 512, 4, 256, 4),  # 1B down
    (3072, 3072): GemvConfig("stream", 8, 512, 4, 384, 4),  # 3B o
    (16384, 3072): GemvConfig("stream", 16, 512, 4, 264, 3),  # 3B gate_up
    (3072, 8192): GemvConfig("stream", 8, 512, 4, 384, 4),  # 3B down
    (128256, 2048): GemvConfig("split", 8, 2048, 8),  # 1B lm_head
    (128256, 3072): GemvConfig("split", 4, 4096, 8),  # 3B lm_head
    # Llama 3.2 11B-Vision's text decoder (its cross layers' q is the o shape); the rule's persistent kernel was
    # slower at each, down by 1.8× (docs/performance.md, vision decode)
    (4096, 4096): GemvConfig("stream", 8, 512, 4, 512, 4),  # 11B o, cross q
    (28672, 4096): GemvConfig("stream", 16, 512, 4, 264, 3),  # 11B gate_up
    (4096, 14336): GemvConfig("stream", 16, 512, 4, 256, 3),  # 11B down
    (128256, 4096): GemvConfig("stream", 8, 512, 4, 396, 4),  # 11B lm_head
    # one rank's shard at --tp 2 (accel/tp/shard.py: o and down with K/2 inputs, gate_up with 2F/2 rows)
    (2048, 1024): GemvConfig("split", 8, 1024, 4),  # 1B o
    (8192, 2048): GemvConfig("split", 8, 2048, 8),  # 1B gate_up
    (2048, 4096): GemvConfig("stream", 8, 512, 4, 256, 4),  # 1B down
    (3072, 1536): GemvConfig("stream", 8, 512, 4, 384, 4),  # 3B o
    (8192, 3072): GemvConfig("stream", 8, 512, 4, 396, 4),  # 3B gate_up
    (3072, 4096): GemvConfig("stream", 8, 512, 4, 384, 4),  # 3B down
    # Llama 3.2 90B-Vision's decoder, one rank's shard at --tp 2 (accel.tp); the rule's persistent kernel was
    # slower at each, down by 1.4× (docs/performance.md, tensor-parallel Vision)
    (8192, 4096): GemvConfig("stream", 8, 512, 4, 528, 4),  # 90B TP=2 o
    (4096, 8192): GemvConfig("stream", 16, 512, 4, 256, 3),  # 90B TP=2 cross q
    (28672, 8192): GemvConfig("stream", 8, 512, 4, 528, 4),  # 90B TP=2 gate_up
    (8192, 14336): GemvConfig("stream", 16, 512, 4, 264, 3),  # 90B TP=2 down
    (64128, 8192): GemvConfig("stream", 8, 512, 4, 396, 4),  # 90B TP=2 lm_head
})

# The fused norm + qkv + RoPE + cache write, per (N, K) = ((H + 2K)·E, D): 1B one whole-row tile pair a program;
# 3B the streaming kernel, 8 × 512 tile pairs, 3 stages.
QKV_ROPE: Mapping[tuple[int, int], QkvConfig] = MappingProxyType({
    (3072, 2048): QkvConfig(2, 8),
    (5120, 3072): QkvConfig(8, 4, stages=3, block_k=512),
    (6144, 4096): QkvConfig(4, 4, stages=3, block_k=1024, programs=264),  # 11B-Vision (tools/bench/vision.py)
})


class QGemvConfig(NamedTuple):
    """The quantized GEMV (accel/kernels/qgemv.py): [block_n, block_k] tiles (block_k in columns), `split_k` K
    slices a row block (the qkv + RoPE kernel takes 1), `stages` tiles in flight a program (1: no pipeline)."""
    block_n: int
    block_k: int
    warps: int
    split_k: int
    stages: int
    programs: int = 0  # > 0: persistent, this many programs loop over the row blocks (one K slice, one tile a row)


# The quantized GEMV per (N, K, bits, group), ("rope",) appended for the fused qkv + RoPE kernel; shapes not
# listed use `qgemv.qgemv_config`'s rule. The fastest config of the sweeps (tools.bench.sweeps.qgemv) where it beat
# the rule (or the row before it) by > 2%, for int8 (one scale a row: group = K) and int4:64 at the Llama 3.2 1B / 3B
# decode shapes (gate_up, lm_head, qkv and 3B o: one or two warps of 8, 16 or 32 rows over the whole row, a 3-4
# stage cp.async pipeline over its tiles; 32 rows share each column's f(x) fixed point at int4). The 1B int8 qkv and
# 3B int8 down rows won in the engine itself (a search of one role's config at a time). A sixth
# field: persistent programs, each looping over row blocks of one whole-row tile.
QGEMV: Mapping[tuple, QGemvConfig] = MappingProxyType({
    (3072, 2048, 8, 2048, "rope"): QGemvConfig(8, 2048, 4, 1, 1),  # 1B qkv
    (2048, 2048, 8, 2048): QGemvConfig(8, 2048, 4, 1, 1),  # 1B o
    (16384, 2048, 8, 2048): QGemvConfig(32, 512, 2, 1, 3),  # 1B gate_up
    (16384, 2048, 4, 64): QGemvConfig(32, 1024, 2, 1, 3),
    (2048, 8192, 8, 8192): QGemvConfig(16, 512, 2, 8, 2),  # 1B down
    (128256, 2048, 8, 2048): QGemvConfig(16, 512, 1, 1, 3),  # 1B lm_head
    (128256, 2048, 4, 64): QGemvConfig(32, 2048, 4, 1, 3, 396),
    (5120, 3072, 8, 3072, "rope"): QGemvConfig(16, 512, 2, 1, 3),  # 3B qkv
    (5120, 3072, 4, 64, "rope"): QGemvConfig(16, 1024, 4, 1, 2),
    (3072, 3072, 8, 3072): QGemvConfig(8, 512, 1, 1, 3),  # 3B o
    (3072, 3072, 4, 64): QGemvConfig(8, 4096, 2, 1, 3, 396),
    (16384, 3072, 8, 3072): QGemvConfig(32, 512, 2, 1, 3),  # 3B gate_up
    (16384, 3072, 4, 64): QGemvConfig(32, 1024, 2, 1, 3),
    (3072, 8192, 8, 8192): QGemvConfig(16, 512, 2, 4, 3),  # 3B down
    (128256, 3072, 8, 3072): QGemvConfig(16, 512, 1, 1, 4),  # 3B lm_head
    (128256, 3072, 4, 64): QGemvConfig(8, 4096, 2, 1, 3, 764),
})


class PdlMode(NamedTuple):
    """How the quantized decode kernels launch on sm_90+ (accel/kernels/qgemv.py, PDL). trigger: "wait" (the next
    kernel may launch once our wait has returned) or "late" (once our main loop is done); prefetch: tiles of a
    program's weights prefetched into L2 before the wait (0: none; more than a program has: all of them)."""
    trigger: str = "wait"
    prefetch: int = 1


# The mode by code width, as measured in the engine: the int4 step gains with the trigger after the wait; int8's
# GEMVs, closer to the bandwidth, ran slower beside an early-launched successor than the overlap saved, and gain
# only with the trigger after the main loop and the 1-tile prefetch. None (plain launches): what off sm_90 runs.
QGEMV_PDL: Mapping[int, PdlMode | None] = MappingProxyType({4: PdlMode("wait", 1), 8: PdlMode("late", 1)})


class MatmulConfig(NamedTuple):
    """The weight-streaming GEMM (accel/kernels/matmul.py): a program multiplies [block_n, K / split_k] of the
    weight by [block_m, K / split_k] of the activations in [.., block_k] tiles, `stages` tiles in flight."""
    block_n: int
    block_k: int
    block_m: int
    split_k: int
    warps: int
    stages: int


# The batched decode step's GEMMs per (N, K, bucket): the bucket is the row count rounded up to a power of two (the
# decode graphs' buckets). Only where the sweep (tools.bench.sweeps.skinny, rows 1-256) measured the kernel faster
# than cuBLAS by more than 3%: the lm_head up to 128 rows, gate_up, down and the 3B o at 1-32 rows; cuBLAS kept qkv,
# the 1B o, the rest from 64 rows and everything at 256.
MATMUL: Mapping[tuple[int, int, int], MatmulConfig] = MappingProxyType({
    (16384, 2048, 1): MatmulConfig(128, 128, 16, 1, 8, 3),  # 1B gate_up
    (16384, 2048, 4): MatmulConfig(128, 128, 16, 1, 8, 3),  # 1B gate_up
    (16384, 2048, 8): MatmulConfig(128, 128, 16, 1, 8, 3),  # 1B gate_up
    (16384, 2048, 16): MatmulConfig(64, 128, 16, 1, 4, 4),  # 1B gate_up
    (16384, 2048, 32): MatmulConfig(128, 128, 32, 1, 8, 3),  # 1B gate_up
    (2048, 8192, 1): MatmulConfig(64, 128, 16, 4, 4, 4),  # 1B down
    (2048, 8192, 2): MatmulConfig(64, 256, 16, 4, 4, 3),  # 1B down
    (2048, 8192, 4): MatmulConfig(64, 128, 16, 4, 4, 4),  # 1B down
    (2048, 8192, 8): MatmulConfig(64, 256, 16, 4, 4, 3),  # 1B down
    (2048, 8192, 16): MatmulConfig(64, 128, 16, 4, 4, 4),  # 1B down
    (2048, 8192, 32): MatmulConfig(64, 128, 32, 4, 4, 4),  # 1B down
    (128256, 2048, 1): MatmulConfig(64, 256, 16, 1, 4, 3),  # 1B lm_head
    (128256, 2048, 2): MatmulConfig(64, 256, 16, 1, 4, 3),  # 1B lm_head
    (128256, 2048, 4): MatmulConfig(64, 256, 16, 1, 4, 3),  # 1B lm_head
    (128256, 2048, 8): MatmulConfig(64, 256, 16, 1, 4, 3),  # 1B lm_head
    (128256, 2048, 16): MatmulConfig(128, 128, 16, 1, 8, 3),  # 1B lm_head
    (128256, 2048, 32): MatmulConfig(128, 128, 32, 1, 8, 3),  # 1B lm_head
    (128256, 2048, 64): MatmulConfig(128, 128, 64, 1, 8, 3),  # 1B lm_head
    (128256, 2048, 128): MatmulConfig(64, 64, 128, 1, 4, 3),  # 1B lm_head
    (3072, 3072, 1): MatmulConfig(64, 128, 16, 4, 4, 4),  # 3B o
    (3072, 3072, 2): MatmulConfig(64, 128, 16, 4, 4, 4),  # 3B o
    (3072, 3072, 4): MatmulConfig(64, 128, 16, 4, 4, 4),  # 3B o
    (3072, 3072, 8): MatmulConfig(64, 128, 16, 4, 4, 4),  # 3B o
    (3072, 3072, 16): MatmulConfig(64, 128, 16, 4, 4, 4),  # 3B o
    (16384, 3072, 2): MatmulConfig(128, 128, 16, 1, 8, 3),  # 3B gate_up
    (16384, 3072, 16): MatmulConfig(64, 128, 16, 1, 4, 4),  # 3B gate_up
    (16384, 3072, 32): MatmulConfig(64, 128, 32, 1, 4, 4),  # 3B gate_up
    (3072, 8192, 1): MatmulConfig(64, 128, 16, 4, 4, 4),  # 3B down
    (3072, 8192, 4): MatmulConfig(64, 128, 16, 4, 4, 4),  # 3B down
    (3072, 8192, 8): MatmulConfig(64, 128, 16, 4, 4, 4),  # 3B down
    (3072, 8192, 16): MatmulConfig(64, 128, 16, 4, 4, 4),  # 3B down
    (128256, 3072, 1): MatmulConfig(64, 256, 16, 1, 4, 3),  # 3B lm_head
    (128256, 3072, 2): MatmulConfig(64, 256, 16, 1, 4, 3),  # 3B lm_head
    (128256, 3072, 4): MatmulConfig(128, 128, 16, 1, 8, 3),  # 3B lm_head
    (128256, 3072, 8): MatmulConfig(64, 256, 16, 1, 4, 3),  # 3B lm_head
    (128256, 3072, 16): MatmulConfig(128, 128, 16, 1, 8, 3),  # 3B lm_head
    (128256, 3072, 32): MatmulConfig(128, 128, 32, 1, 8, 3),  # 3B lm_head
    (128256, 3072, 64): MatmulConfig(128, 128, 64, 1, 8, 3),  # 3B lm_head
    (128256, 3072, 128): MatmulConfig(256, 64, 128, 1, 8, 3),  # 3B lm_head
})


# The batched step's gate_up GEMM with SwiGLU in its epilogue (accel/kernels/matmul.py swiglu_matmul_fwd) per
# (2F, K, bucket) of the fused gate_up weight; block_n counts gate rows (a program reads 2·block_n weight rows).
# Only where the sweep (tools.bench.sweeps.skinny --swiglu) measured it faster than the path it replaces (the gate_up
# GEMM by MATMUL or cuBLAS, then the SwiGLU kernel) by more than 3%: every bucket 1-256 at the 1B and 3B shapes;
# shapes not listed take that path.
SWIGLU_MATMUL: Mapping[tuple[int, int, int], MatmulConfig] = MappingProxyType({
    (16384, 2048, 1): MatmulConfig(64, 128, 16, 1, 4, 4),  # 1B gate_up
    (16384, 2048, 2): MatmulConfig(64, 128, 16, 1, 4, 4),  # 1B gate_up
    (16384, 2048, 4): MatmulConfig(64, 128, 16, 1, 4, 4),  # 1B gate_up
    (16384, 2048, 8): MatmulConfig(64, 128, 16, 1, 4, 4),  # 1B gate_up
    (16384, 2048, 16): MatmulConfig(64, 128, 16, 1, 4, 4),  # 1B gate_up
    (16384, 2048, 32): MatmulConfig(64, 128, 32, 1, 8, 3),  # 1B gate_up
    (16384, 2048, 64): MatmulConfig(64, 128, 64, 1, 4, 4),  # 1B gate_up
    (16384, 2048, 128): MatmulConfig(64, 128, 128, 1, 4, 3),  # 1B gate_up
    (16384, 2048, 256): MatmulConfig(64, 64, 256, 1, 8, 4),  # 1B gate_up
    (16384, 3072, 1): MatmulConfig(64, 128, 16, 1, 4, 4),  # 3B gate_up
    (16384, 3072, 2): MatmulConfig(64, 128, 16, 1, 4, 4),  # 3B gate_up
    (16384, 3072, 4): MatmulConfig(64, 128, 16, 1, 4, 4),  # 3B gate_up
    (16384, 3072, 8): MatmulConfig(64, 128, 16, 1, 4, 4),  # 3B gate_up
    (16384, 3072, 16): MatmulConfig(64, 128, 16, 1, 4, 4),  # 3B gate_up
    (16384, 3072, 32): MatmulConfig(64, 128, 32, 1, 4, 4),  # 3B gate_up
    (16384, 3072, 64): MatmulConfig(64, 64, 64, 1, 4, 6),  # 3B gate_up
    (16384, 3072, 128): MatmulConfig(64, 128, 128, 1, 4, 3),  # 3B gate_up
    (16384, 3072, 256): MatmulConfig(64, 64, 256, 1, 8, 4),  # 3B gate_up
})


class Tuning(NamedTuple):
    """The launch tables the decode step's fused ops read (accel.ops.fused and the quantized matrices' products,
    accel.quant_ops.QuantTensor): GEMV, QKV_ROPE, QGEMV, QGEMV_PDL and the decode attention's keyword options
    (accel.kernels.decode_attn.decode_attention_fwd: split_len, max_len, config; cross_decode_attention_fwd:
    split_len, config)."""
    gemv: Mapping[tuple[int, int], GemvConfig] = GEMV
    qkv_rope: Mapping[tuple[int, int], QkvConfig] = QKV_ROPE
    qgemv: Mapping[tuple, QGemvConfig] = QGEMV
    qgemv_pdl: Mapping[int, PdlMode | None] = QGEMV_PDL
    decode_attention: Mapping[str, object] = MappingProxyType({})
    cross_attention: Mapping[str, object] = MappingProxyType({})  # cross_decode_attention_fwd's (split_len, config)


DEFAULT = Tuning()

# The decode attention (accel/kernels/decode_attn.py), from its sweeps (full caches, H=32 K=8 E=64):
DECODE_PREFETCH_SLOTS = 64  # slots a split prefetches into L2 before the PDL wait
LONG_CONTEXT = 8192  # caches from this many slots take the long-context launch (TMA, 256-slot blocks, PDL)
LONGER_CONTEXT = 16384  # and from this many, at E <= 64, its double-buffered 128-slot blocks with q late
# Many query heads a kv head (the vision encoder's padding rows): the separate combine kernel over splits of
# MANY_ROWS_SPLIT keys past MANY_QUERY_ROWS query heads a kv head
MANY_QUERY_ROWS = 16
MANY_ROWS_SPLIT = 512

ARGMAX_BLOCK = 1024  # accel/kernels/argmax.py: 126 programs for V = 128256, about one an SM
DEQUANT_BLOCK = (16, 512, 4)  # accel/kernels/qdequant.py (BLOCK_N, BLOCK_K, warps): 16 rows × 512 columns a program
