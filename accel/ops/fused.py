"""The fused ops (contract: accel.ops.fused_interface), each a Triton kernel or its torch version
(accel.ops.dispatch). The ops multiplying by a weight matrix call the matrix's own method (`matrix`): a quantized
matrix chooses its kernels itself (accel.quant_ops.QuantTensor), a plain tensor takes accel.ops.dense's."""
from __future__ import annotations

import torch

from ..kernels.argmax import argmax_fwd
from ..kernels.decode_attn import cross_decode_attention_fwd, decode_attention_fwd
from ..kernels.flash_attn import cross_attention_fwd, flash_attention_fwd
from ..kernels.rms_norm import add_rms_norm_fwd, embedding_rms_norm_fwd
from ..kernels.rope import rope_kv_write_fwd
from ..kernels.swiglu import swiglu_gate_up_fwd
from ..kernels.tuning import DEFAULT, Tuning
from .dense import DenseMatrix
from .dispatch import rows, uses_triton
from .torch_ops import (torch_add_rms_norm, torch_argmax_row, torch_causal_attention, torch_decode_attention,
                        torch_embedding_rms_norm, torch_greedy_next, torch_norm_cross_attention, torch_rope_kv_write,
                        torch_swiglu_gate_up)


def add_rms_norm(x, residual, weight, eps):
    if uses_triton(x):
        D = x.shape[-1]
        s, h = add_rms_norm_fwd(rows(x).reshape(-1, D), rows(residual).reshape(-1, D), rows(weight), eps)
        return s.reshape(x.shape), h.reshape(x.shape)
    return torch_add_rms_norm(x, residual, weight, eps)


def embedding_rms_norm(ids, table, weight, eps):
    ids = ids.to(table.device)
    if uses_triton(table):
        return embedding_rms_norm_fwd(ids.reshape(-1), rows(table), rows(weight), eps)
    return torch_embedding_rms_norm(ids, table, weight, eps)


def rope_kv_write(q, k, v, cos, sin, cache_k, cache_v, positions):
    positions = positions.to(q.device)
    if uses_triton(q):
        return rope_kv_write_fwd(rows(q), rows(k), rows(v), rows(cos), rows(sin), cache_k, cache_v, positions)
    return torch_rope_kv_write(q, k, v, cos, sin, cache_k, cache_v, positions)


def swiglu_gate_up(gate_up):
    if uses_triton(gate_up):
        return swiglu_gate_up_fwd(rows(gate_up))
    return torch_swiglu_gate_up(gate_up)


def causal_attention(q, cache_k, cache_v, positions):
    if uses_triton(q):
        return flash_attention_fwd(rows(q), cache_k, cache_v, positions)
    return torch_causal_attention(q, cache_k, cache_v, positions)


def decode_attention(q, cache_k, cache_v, position, tuning: Tuning = DEFAULT):
    if uses_triton(q):
        # pdl: the step's previous kernel (qkv_rope) writes q and the cache slot, never the position
        return decode_attention_fwd(rows(q), cache_k, cache_v, position, **{"pdl": True, **tuning.decode_attention})
    return torch_decode_attention(q, cache_k, cache_v, position)


def matrix(weight):
    """weight with the decode step's products as methods: a quantized matrix (accel.quant_ops.QuantTensor) carries
    its own kernels; a plain tensor takes accel.ops.dense.DenseMatrix's."""
    return DenseMatrix(weight) if isinstance(weight, torch.Tensor) else weight


def qkv_rope(x, norm_weight, weight, eps, cos, sin, position, cache_k, cache_v, tuning: Tuning = DEFAULT):
    return matrix(weight).qkv_rope(x, norm_weight, eps, cos, sin, position, cache_k, cache_v, tuning)


def norm_linear(x, norm_weight, weight, eps, tuning: Tuning = DEFAULT):
    return matrix(weight).norm_linear(x, norm_weight, eps, tuning)


def linear_add(a, weight, residual, tuning: Tuning = DEFAULT, gate=None, accumulate: bool = True):
    return matrix(weight).linear_add(a, residual, tuning, gate, accumulate)


def swiglu_linear_add(gate_up, weight, residual, tuning: Tuning = DEFAULT, gate=None, accumulate: bool = True):
    return matrix(weight).swiglu_linear_add(gate_up, residual, tuning, gate, accumulate)


def norm_mlp_add(x, norm_weight, gate_up, down, eps, tuning: Tuning = DEFAULT, accumulate: bool = True):
    return matrix(gate_up).norm_mlp_add(x, norm_weight, matrix(down), eps, tuning, accumulate)


def norm_cross_attention(q, norm_weight, eps, keys, values, visible, tuning: Tuning = DEFAULT):
    if uses_triton(q):
        if q.shape[0] == 1:  # the decode step: split along the image tokens
            return cross_decode_attention_fwd(rows(q), keys, values, rows(visible), norm_weight, eps,
                                              **tuning.cross_attention)
        return cross_attention_fwd(rows(q), keys, values, rows(visible), norm_weight, eps)
    return torch_norm_cross_attention(q, norm_weight, eps, keys, values, visible)


def argmax_row(logits):
    v = logits.reshape(-1)
    if uses_triton(v) and v.stride(0) == 1:
        return argmax_fwd(v)
    return torch_argmax_row(v)


def greedy_next(logits, token, position, history, step):
    if uses_triton(logits):
        return argmax_fwd(logits, token, position, history, step)
    return torch_greedy_next(logits, token, position, history, step)
