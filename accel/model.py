"""The fast forward: prefill (whole prompt) and the one-token decode step, over fused weights and a static cache.

Same computation as `refimpl.model.llama.forward` (the trace mode runs that one over `accel.ops`), rearranged for speed
with the fused ops of accel.ops (contract: accel/ops/fused_interface.py):
    * fused QKV and gate_up GEMMs (accel.weights); prefill: the residual adds in the o and down GEMMs' epilogue
      (cuBLAS, beta = 1); decode: in the GEMVs' epilogue;
    * RoPE fused into the KV-cache write (k is rotated straight into the cache slot, v copied beside it);
    * prefill attends with flash attention over the fresh k/v; decode with the split-sequence decode kernel over
      the cache, its context length a device tensor so that one CUDA graph serves every position;
    * decode reads cos/sin rows from tables precomputed for the whole cache and indexes them on the device;
    * decode's projections are GEMVs with the RMSNorm, SwiGLU and residual add folded in, and the qkv GEMV
      carrying RoPE and the cache write: 5 launches a layer instead of 11.
Nothing here yields, syncs with the host, or allocates a size that depends on the position: `decode_step` is
what the engine captures in a CUDA graph.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from refimpl.model.config import LlamaConfig

from . import ops
from .kernels.common import pdl_launches
from .kernels.tuning import DEFAULT, Tuning
from .ops.torch_ops import split_qkv
from .quant_layers import prefill_weights
from .weights import Weights


@dataclass
class RopeTables:
    cos: torch.Tensor  # [S, E/2] fp32, row p for position p
    sin: torch.Tensor  # [S, E/2] fp32
    slots: torch.Tensor = field(init=False)  # [S] int64, 0..S-1: a prefill's positions are a slice (no launch)

    def __post_init__(self):
        self.slots = torch.arange(self.cos.shape[0], device=self.cos.device)


def self_layer(lw, cfg: LlamaConfig, x, h, next_norm, cos, sin, cache_k, cache_v, positions, last_row=False):
    """One self-attention layer over the residual stream x [T, D] and its normed h -> (x, next_norm(x)).

    Causal attention over cache_k/cache_v [K, S, E], into which this chunk's k/v are written at `positions` first.
    o and down add their products into the stream x (in place, in cuBLAS's epilogue, beta = 1: the sum rounded
    once, and the norm after it reads one [T, D]; a quantized matrix's own product adds in add_rms_norm's pass),
    then each block's input is normalized.
    last_row: every row's k/v, then only the last token's row onwards (x, h [1, D]): a prompt's last layer, whose
    other rows nothing reads.
    """
    eps = cfg.rms_norm_eps
    H, K, E = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    qkv = ops.linear(h, lw.qkv)  # [T, D] -> [T, (H+2K)·E]
    q, k, v = split_qkv(qkv, H, K, E)
    q_rot = ops.rope_kv_write(q, k, v, cos, sin, cache_k, cache_v, positions)  # k_rot, v -> cache
    if last_row:
        q_rot, x, positions = q_rot[-1:], x[-1:], positions[-1:]
    a = ops.causal_attention(q_rot, cache_k, cache_v, positions)  # [T, H, E]
    a = a.reshape(x.shape[0], H * E)
    in_gemm = _dense(lw.o, lw.down)
    x, h = _project_add_norm(a, lw.o, x, lw.mlp_norm, eps, in_gemm)  # resid_mid, mlp_norm
    act = ops.swiglu_gate_up(ops.linear(h, lw.gate_up))  # [T, D] -> [T, 2F] -> [T, F]
    return _project_add_norm(act, lw.down, x, next_norm, eps, in_gemm)  # resid_post, next attn_norm


def _dense(*weights) -> bool:
    """Plain tensors (cuBLAS's addmm), not quantized matrices (their own GEMM through F.linear)."""
    return all(isinstance(w, torch.Tensor) for w in weights)


def _project_add_norm(a, weight, x, norm_weight, eps, in_gemm: bool):
    """a [T, N] -> (x + a·weightᵀ, its RMSNorm) [T, D] each: the add in the norm's pass, or (in_gemm) in the GEMM's
    epilogue, x updated in place (every x here is the prefill's own buffer, never a weight)."""
    if not in_gemm:
        return ops.add_rms_norm(ops.linear(a, weight), x, norm_weight, eps)
    x.addmm_(a, weight.t())  # [T, N] @ [N, D] + x
    return x, ops.rms_norm(x, norm_weight, eps)


def _layers(w: Weights, cfg: LlamaConfig, x, h, cos, sin, cache_k, cache_v, positions):
    """The decoder layers over the residual stream x [T, D] and h, its first attention norm; returns final_norm(x)
    of the rows the logits need (the last one: the last layer runs past its k/v on the last token's row only). A
    packed quantized layer is dequantized whole into a scratch first (accel.quant_layers.prefill_weights: one
    launch instead of one a matrix)."""
    last = len(w.layers) - 1
    for i, lw in enumerate(w.layers):
        next_norm = w.layers[i + 1].attn_norm if i < last else w.norm
        x, h = self_layer(prefill_weights(lw, x), cfg, x, h, next_norm, cos, sin, cache_k[i], cache_v[i], positions,
                          last_row=i == last)
    return h


def prefill(w: Weights, cfg: LlamaConfig, ids, tables: RopeTables, cache_k, cache_v, start: int = 0):
    """ids [T] int on the device, a prompt at positions start..start+T-1 -> last-token logits [1, V] (model dtype).

    cache_k/cache_v [L, K, S, E]: slots start..start+T-1 of every layer are written; slots before start must
    already hold the earlier tokens (a chat continuing its history).
    """
    T = ids.shape[0]
    positions = tables.slots[start:start + T]  # [T]
    cos, sin = tables.cos[start:start + T], tables.sin[start:start + T]  # [T, E/2]
    with pdl_launches():  # the Triton kernels launched as programmatic dependents (accel.kernels.common)
        x, h = ops.embedding_rms_norm(ids, w.embed, w.layers[0].attn_norm, cfg.rms_norm_eps)  # [T, D] each
        h = _layers(w, cfg, x, h, cos, sin, cache_k, cache_v, positions)
        return ops.linear(h[-1:], w.lm_head)  # [1, D] -> [1, V]: only the next token's logits


class WholeModel:
    """What the decode step does where the model is split: nothing, on one device. A tensor-parallel rank's
    counterpart (accel.tp.model.RankSplit) looks up its vocabulary rows, sums the residual stream's partial sums
    over the ranks and gathers the logits."""

    owner = True  # this device's o/down products add to the residual stream (the others' overwrite it)

    @staticmethod
    def embedding(token, table):
        return ops.embedding(token, table)  # [1, D]

    @staticmethod
    def reduce(x) -> None:
        """x [1, D]: the residual stream after o or down (summed over the ranks, in place)."""

    @staticmethod
    def gather(logits):
        return logits  # [1, V]


WHOLE = WholeModel()


def decode_step(w: Weights, cfg: LlamaConfig, token, position, tables: RopeTables, cache_k, cache_v,
                tuning: Tuning = DEFAULT, split=WHOLE):
    """token [1] int, position [1] int (both on the device) -> logits [1, V]. Capturable in a CUDA graph.

    The roundings of `_layers` with each residual add after its product's rounding (the prefill's dense layers
    round each residual sum once, inside cuBLAS), with the GEMVs carrying the neighbours:
    attn norm + RoPE + cache write around the qkv GEMV, mlp norm in gate_up's prologue, SwiGLU in down's
    prologue (quantized: in gate_up's epilogue), the residual adds in o/down's epilogue, the final norm in the
    lm_head's prologue. split: WHOLE, or one tensor-parallel rank's part (accel.tp.model.RankSplit: w and cfg
    are then the rank's shard and local config).
    """
    eps = cfg.rms_norm_eps
    cos, sin = tables.cos, tables.sin  # [S, E/2]: qkv_rope reads row `position` on the device
    x = split.embedding(token, w.embed)  # [1, D], a fresh buffer: the layers update it in place
    for i, lw in enumerate(w.layers):
        decode_layer(lw, cfg, x, position, cos, sin, cache_k[i], cache_v[i], tuning, split)
    return split.gather(ops.norm_linear(x, w.norm, w.lm_head, eps, tuning))  # [1, D] -> [1, V]


def decode_layer(lw, cfg: LlamaConfig, x, position, cos, sin, cache_k, cache_v, tuning: Tuning = DEFAULT,
                 split=WHOLE):
    """One self-attention layer of the decode step, updating x [1, D] in place (5 launches). Split over ranks,
    the rank owning the residual stream adds its o/down partial sums to x, the others overwrite x with theirs
    (they have read it), and split.reduce sums x over the ranks: x + Σ partials, the all-reduce the only launch
    added."""
    eps, add = cfg.rms_norm_eps, split.owner
    q_rot = ops.qkv_rope(x, lw.attn_norm, lw.qkv, eps, cos, sin, position, cache_k, cache_v, tuning)  # [1, H, E]
    a = ops.decode_attention(q_rot, cache_k, cache_v, position, tuning)  # [1, H, E] over slots 0..pos
    ops.linear_add(a.reshape(1, -1), lw.o, x, tuning, accumulate=add)  # x += o(a): resid_mid
    split.reduce(x)
    ops.norm_mlp_add(x, lw.mlp_norm, lw.gate_up, lw.down, eps, tuning, accumulate=add)  # x += down(silu(gate)·up)
    split.reduce(x)  # resid_post
