"""The op interface (`refimpl.model.interface`) on torch tensors, bf16 or fp32, any device; trace mode runs
`refimpl.model.llama.forward_steps` over these.

The vision ops (`layer_norm`, `gelu`, `encoder_attention`; refimpl.model.interface.VisionOps) are their torch
versions on every device: trace mode runs the encoder once per image; the fast encoder (accel.vision.encoder)
batches every tile of every image into torch's fused kernels instead.
GEMMs stay on torch (`linear`, `lora_merge`): cuBLAS is at the roofline already. `rope_tables` and
`cross_attention` are torch code on every device: tables are computed once per forward, and cross-attention runs
once per image over a few thousand keys, where fp32 torch matmuls are exact and fast enough.
"""
from __future__ import annotations

import functools

import numpy as np
import torch
import torch.nn.functional as F

from refimpl.model.config import RopeScaling
from refimpl.model.ops import llama3_inv_freq

from ..kernels.embedding import embedding_fwd
from ..kernels.rms_norm import rms_norm_fwd
from ..kernels.rope import rope_fwd
from ..kernels.swiglu import swiglu_fwd
from .dispatch import rows, uses_triton
from .fused import causal_attention, decode_attention
from .torch_ops import (add_lora, kv_write, torch_encoder_attention, torch_gelu, torch_grouped_attention,
                        torch_layer_norm, torch_rms_norm, torch_rotate, torch_swiglu)


def embedding(ids, table):
    ids = ids.to(table.device)
    if uses_triton(table):
        return embedding_fwd(ids.reshape(-1), rows(table)).reshape(*ids.shape, table.shape[1])
    return table[ids]  # [V, D][T] -> [T, D]


def rms_norm(x, weight, eps):
    if uses_triton(x):
        D = x.shape[-1]
        return rms_norm_fwd(rows(x).reshape(-1, D), rows(weight), eps).reshape(x.shape)
    return torch_rms_norm(x, weight, eps)


@functools.lru_cache(maxsize=32)
def _inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None, device: torch.device) -> torch.Tensor:
    # the NumPy reference's own fp32 computation (HF's order), so both backends share bit-identical frequencies
    return torch.from_numpy(np.ascontiguousarray(llama3_inv_freq(head_dim, theta, scaling))).to(device)


def rope_tables(positions, head_dim, theta, scaling):
    positions = torch.as_tensor(positions)
    inv_freq = _inv_freq(head_dim, float(theta), scaling, positions.device)  # [E/2] fp32
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [T, 1] * [1, E/2] -> [T, E/2], fp32 as HF
    return torch.cos(angles), torch.sin(angles)


def rope(q, k, cos, sin):
    cos, sin = cos.to(q.device, torch.float32), sin.to(q.device, torch.float32)
    if uses_triton(q):
        return rope_fwd(rows(q), rows(k), rows(cos), rows(sin))
    return torch_rotate(q, cos, sin), torch_rotate(k, cos, sin)


def linear(x, weight):
    return F.linear(x, weight)  # [T, Din] @ [Din, Dout] -> [T, Dout]


def attention(q, k, v, cache_k, cache_v, positions):
    positions = positions.to(q.device)
    kv_write(k, v, cache_k, cache_v, positions)
    if q.shape[0] == 1 and uses_triton(q):  # one new token: split-K decode over the cache, length on the device
        return decode_attention(q, cache_k, cache_v, positions)
    return causal_attention(q, cache_k, cache_v, positions)


def cross_attention(q, k, v, mask=None):
    T, N = q.shape[0], k.shape[1]
    visible = (torch.ones((T, N), dtype=torch.bool, device=q.device) if mask is None
               else torch.as_tensor(mask).to(q.device, torch.bool))  # [T, N]
    # A text token before any image sees no key; attend to everything and then zero the row, as Mllama does.
    empty = ~visible.any(dim=-1)  # [T]
    out = torch_grouped_attention(q, k, v, visible | empty[:, None])
    return out.masked_fill(empty[:, None, None], 0.0).to(q.dtype)  # [T, H, E]


def swiglu(gate, up):
    if uses_triton(gate):
        F_ = gate.shape[-1]
        return swiglu_fwd(rows(gate).reshape(-1, F_), rows(up).reshape(-1, F_)).reshape(gate.shape)
    return torch_swiglu(gate, up)


def lora_merge(weight, lora_a, lora_b, scale):
    delta = lora_b.float() @ lora_a.float()  # [Dout, R] @ [R, Din] -> [Dout, Din], fp32 (bf16 would round twice)
    return (weight.float() + float(scale) * delta).to(weight.dtype)


def lora_linear(x, weight, lora_a, lora_b, scale):
    """The interface op: x [..., Din], weight [Dout, Din], lora_a [R, Din], lora_b [Dout, R] -> [..., Dout]."""
    return add_lora(F.linear(x, weight), x, lora_a, lora_b, scale)


# ---- vision ops (refimpl.model.interface.VisionOps) ----

def layer_norm(x, weight, bias, eps):
    return torch_layer_norm(x, weight, bias, eps)


def gelu(x):
    return torch_gelu(x)


def encoder_attention(q, k, v, mask=None):
    return torch_encoder_attention(q, k, v, mask)
