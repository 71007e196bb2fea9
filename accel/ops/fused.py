"""The fused ops (contract: accel.ops.fused_interface), each a Triton kernel or its torch version
(accel.ops.dispatch)."""
from __future__ import annotations

import torch

from .. import quant_ops as quant
from ..kernels.argmax import argmax_fwd
from ..kernels.decode_attn import cross_decode_attention_fwd, decode_attention_fwd
from ..kernels.flash_attn import cross_attention_fwd, flash_attention_fwd
from ..kernels.gemv import gemv_fwd
from ..kernels.qkv_rope import qkv_rope_fwd
from ..kernels.rms_norm import add_rms_norm_fwd, embedding_rms_norm_fwd
from ..kernels.rope import rope_kv_write_fwd
from ..kernels.swiglu import swiglu_gate_up_fwd
from ..kernels.tuning import DEFAULT, Tuning
from .dispatch import rows, uses_triton
from .torch_ops import (torch_add_rms_norm, torch_argmax_row, torch_causal_attention, torch_decode_attention,
                        torch_embedding_rms_norm, torch_greedy_next, torch_linear_add, torch_norm_cross_attention,
                        torch_norm_linear, torch_qkv_rope, torch_rope_kv_write, torch_swiglu_gate_up,
                        torch_swiglu_linear_add)


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


def qkv_rope(x, norm_weight, weight, eps, cos, sin, position, cache_k, cache_v, tuning: Tuning = DEFAULT):
    if is_quantized(weight):
        return quant.quant_qkv_rope(x, norm_weight, weight, eps, cos, sin, position, cache_k, cache_v)
    if uses_triton(x):
        return qkv_rope_fwd(weight, x, norm_weight, eps, cos, sin, position, cache_k, cache_v, table=tuning.qkv_rope)
    return torch_qkv_rope(x, norm_weight, weight, eps, cos, sin, position, cache_k, cache_v)


def norm_linear(x, norm_weight, weight, eps, tuning: Tuning = DEFAULT):
    if is_quantized(weight):
        return quant.quant_norm_linear(x, norm_weight, weight, eps)
    if uses_triton(x):
        return gemv_fwd(weight, x, norm_weight=norm_weight, eps=eps, table=tuning.gemv)
    return torch_norm_linear(x, norm_weight, weight, eps)


def linear_add(a, weight, residual, tuning: Tuning = DEFAULT, gate=None):
    if is_quantized(weight):
        assert gate is None, "the quantized GEMV has no gated epilogue"
        return quant.quant_linear_add(a, weight, residual)
    if uses_triton(a):
        return gemv_fwd(weight, a, residual=residual, gate=gate, out=residual, table=tuning.gemv)
    return torch_linear_add(a, weight, residual, gate)


def swiglu_linear_add(gate_up, weight, residual, tuning: Tuning = DEFAULT, gate=None):
    if is_quantized(weight):
        assert gate is None, "the quantized GEMV has no gated epilogue"
        return quant.quant_swiglu_linear_add(gate_up, weight, residual)
    if uses_triton(gate_up):
        return gemv_fwd(weight, gate_up, swiglu=True, residual=residual, gate=gate, out=residual, table=tuning.gemv)
    return torch_swiglu_linear_add(gate_up, weight, residual, gate)


def norm_mlp_add(x, norm_weight, gate_up, down, eps, tuning: Tuning = DEFAULT):
    if is_quantized(gate_up):
        return quant.quant_norm_mlp_add(x, norm_weight, gate_up, down, eps)
    return swiglu_linear_add(norm_linear(x, norm_weight, gate_up, eps, tuning), down, x, tuning)


def norm_cross_attention(q, norm_weight, eps, keys, values, visible, tuning: Tuning = DEFAULT):
    if uses_triton(q):
        if q.shape[0] == 1:  # the decode step: split along the image tokens
            return cross_decode_attention_fwd(rows(q), keys, values, rows(visible), norm_weight, eps,
                                              **tuning.cross_attention)
        return cross_attention_fwd(rows(q), keys, values, rows(visible), norm_weight, eps)
    return torch_norm_cross_attention(q, norm_weight, eps, keys, values, visible)


def is_quantized(weight) -> bool:
    """A weight-only quantized matrix (accel.quant_ops.QuantTensor) takes the quantized GEMV of the same fused op."""
    return not isinstance(weight, torch.Tensor)


def argmax_row(logits):
    v = logits.reshape(-1)
    if uses_triton(v) and v.stride(0) == 1:
        return argmax_fwd(v)
    return torch_argmax_row(v)


def greedy_next(logits, token, position, history, step):
    if uses_triton(logits):
        return argmax_fwd(logits, token, position, history, step)
    return torch_greedy_next(logits, token, position, history, step)
