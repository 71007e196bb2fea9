"""The op interface (`refimpl.model.interface`) on torch tensors, bf16 or fp32, any device.

Dispatch, decided per call from the tensor's device:
  * CUDA tensors run the Triton kernels of `accel.kernels` (one file per op: kernel + launcher);
  * CPU tensors run the same kernels under Triton's interpreter when TRITON_INTERPRET=1 (tests/conftest.py sets it
    on machines without CUDA, so CI exercises the kernels' indexing and masking on CPU);
  * otherwise CPU tensors run plain torch code written beside each op (`torch_*`, also the fast path's fallback in
    accel.model), the same math in the same dtype order, so an accel engine still runs on a CPU-only machine without the (slow) interpreter.
The variable is read once, at import: triton decides at `@triton.jit` time (also import time) whether a kernel is
interpreted, so reading it later could route CPU tensors to kernels that cannot run on them.

GEMMs stay on torch (`linear`, `lora_merge`): cuBLAS is at the roofline already. `rope_tables` and
`cross_attention` are torch code on every device: tables are computed once per forward, and cross-attention runs
once per image over a few thousand keys, where fp32 torch matmuls are exact and fast enough.

Besides the interface, three fused ops for the engine's fast path: `add_rms_norm`, `rope_kv_write`,
`swiglu_gate_up`, and `decode_attention` (split-K over the cache with the length read on the device).
"""
from __future__ import annotations

import functools
import math
import os

import numpy as np
import torch
import torch.nn.functional as F

from refimpl.model.config import RopeScaling
from refimpl.model.ops import llama3_inv_freq

from .kernels.decode_attn import decode_attention_fwd
from .kernels.embedding import embedding_fwd
from .kernels.flash_attn import flash_attention_fwd
from .kernels.rms_norm import add_rms_norm_fwd, rms_norm_fwd
from .kernels.rope import rope_fwd, rope_kv_write_fwd
from .kernels.swiglu import swiglu_fwd, swiglu_gate_up_fwd

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def uses_triton(x: torch.Tensor) -> bool:
    """True where this op runs a Triton kernel for x: on CUDA, and on CPU under the interpreter."""
    return x.is_cuda or (INTERPRET and x.device.type == "cpu")


def _rows(x: torch.Tensor) -> torch.Tensor:
    """Kernels index with strides but need unit stride along the last dimension."""
    return x if x.stride(-1) == 1 else x.contiguous()


# ---- embedding ----

def embedding(ids, table):
    ids = ids.to(table.device)
    if uses_triton(table):
        return embedding_fwd(ids.reshape(-1), _rows(table)).reshape(*ids.shape, table.shape[1])
    return table[ids]  # [V, D][T] -> [T, D]


# ---- rms_norm (HF order: fp32 reduce, cast to x's dtype, then weight) ----

def torch_rms_norm(x, weight, eps):
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # [T, D]
    return (normed.to(x.dtype) * weight).to(x.dtype)


def rms_norm(x, weight, eps):
    if uses_triton(x):
        D = x.shape[-1]
        return rms_norm_fwd(_rows(x).reshape(-1, D), _rows(weight), eps).reshape(x.shape)
    return torch_rms_norm(x, weight, eps)


def add_rms_norm(x, residual, weight, eps):
    """(x + residual, rms_norm(x + residual)) in one pass; the sum is rounded to x's dtype before the norm."""
    if uses_triton(x):
        D = x.shape[-1]
        s, h = add_rms_norm_fwd(_rows(x).reshape(-1, D), _rows(residual).reshape(-1, D), _rows(weight), eps)
        return s.reshape(x.shape), h.reshape(x.shape)
    return torch_add_rms_norm(x, residual, weight, eps)


def torch_add_rms_norm(x, residual, weight, eps):
    s = x + residual  # rounded to the activation dtype, as the unfused model does
    return s, torch_rms_norm(s, weight, eps)


# ---- rope ----

@functools.lru_cache(maxsize=32)
def _inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None, device: torch.device) -> torch.Tensor:
    # the NumPy reference's own fp32 computation (HF's order), so both backends share bit-identical frequencies
    return torch.from_numpy(np.ascontiguousarray(llama3_inv_freq(head_dim, theta, scaling))).to(device)


def rope_tables(positions, head_dim, theta, scaling):
    positions = torch.as_tensor(positions)
    inv_freq = _inv_freq(head_dim, float(theta), scaling, positions.device)  # [E/2] fp32
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [T, 1] * [1, E/2] -> [T, E/2], fp32 as HF
    return torch.cos(angles), torch.sin(angles)


def torch_rotate(x, cos, sin):
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]  # [T, H, E] -> 2 × [T, H, E/2]
    c, s = cos[:, None, :], sin[:, None, :]  # [T, E/2] -> [T, 1, E/2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


def rope(q, k, cos, sin):
    cos, sin = cos.to(q.device, torch.float32), sin.to(q.device, torch.float32)
    if uses_triton(q):
        return rope_fwd(_rows(q), _rows(k), _rows(cos), _rows(sin))
    return torch_rotate(q, cos, sin), torch_rotate(k, cos, sin)


def rope_kv_write(q, k, v, cos, sin, cache_k, cache_v, positions):
    """rope(q) returned; rope(k) and v written into cache_k/cache_v [K, S, E] at `positions` (one launch)."""
    positions = positions.to(q.device)
    if uses_triton(q):
        return rope_kv_write_fwd(_rows(q), _rows(k), _rows(v), _rows(cos), _rows(sin), cache_k, cache_v, positions)
    q_rot, k_rot = torch_rotate(q, cos, sin), torch_rotate(k, cos, sin)
    cache_k[:, positions] = k_rot.transpose(0, 1).to(cache_k.dtype)  # [T, K, E] -> [K, T, E] into [K, S, E]
    cache_v[:, positions] = v.transpose(0, 1).to(cache_v.dtype)
    return q_rot


# ---- linear (cuBLAS) ----

def linear(x, weight):
    return F.linear(x, weight)  # [T, Din] @ [Din, Dout] -> [T, Dout]


# ---- attention ----

def torch_grouped_attention(q, k, v, visible):
    """q [T, H, E], k/v [K, N, E], visible [T, N] bool -> [T, H, E] in fp32; every row must see a key."""
    T, H, E = q.shape
    K = k.shape[0]
    qg = q.float().reshape(T, K, H // K, E).permute(1, 2, 0, 3)  # [T, H, E] -> [K, H/K, T, E]
    scores = qg @ k.float()[:, None].transpose(-1, -2) / math.sqrt(E)  # [K, H/K, T, E] @ [K, 1, E, N] -> [K, H/K, T, N]
    scores = scores.masked_fill(~visible, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v.float()[:, None]  # [K, H/K, T, N] @ [K, 1, N, E] -> [K, H/K, T, E]
    return out.permute(2, 0, 1, 3).reshape(T, H, E)  # [K, H/K, T, E] -> [T, H, E]


def attention(q, k, v, cache_k, cache_v, positions):
    positions = positions.to(q.device)
    cache_k[:, positions] = k.transpose(0, 1).to(cache_k.dtype)  # [T, K, E] -> [K, T, E] into [K, S, E]
    cache_v[:, positions] = v.transpose(0, 1).to(cache_v.dtype)
    if uses_triton(q):
        if q.shape[0] == 1:  # one new token: split-K decode over the cache, length read on the device
            return decode_attention_fwd(_rows(q), cache_k, cache_v, positions)
        return flash_attention_fwd(_rows(q), cache_k, cache_v, positions)
    n = int(positions.max()) + 1  # keys 0..n-1 are all any query here may see
    visible = torch.arange(n, device=q.device)[None, :] <= positions[:, None]  # [T, n]: causal by absolute position
    return torch_grouped_attention(q, cache_k[:, :n], cache_v[:, :n], visible).to(q.dtype)


def decode_attention(q, cache_k, cache_v, position, max_len=None, split_len=None):
    """q [1, H, E] over cache slots 0..position (position: [1] int tensor on q's device) -> [1, H, E]."""
    if uses_triton(q):
        return decode_attention_fwd(_rows(q), cache_k, cache_v, position, max_len=max_len, split_len=split_len)
    n = int(position.reshape(-1)[0]) + 1
    visible = torch.ones((q.shape[0], n), dtype=torch.bool, device=q.device)
    return torch_grouped_attention(q, cache_k[:, :n], cache_v[:, :n], visible).to(q.dtype)


def cross_attention(q, k, v, mask=None):
    T, N = q.shape[0], k.shape[1]
    visible = (torch.ones((T, N), dtype=torch.bool, device=q.device) if mask is None
               else torch.as_tensor(mask).to(q.device, torch.bool))  # [T, N]
    # A text token before any image sees no key; attend to everything and then zero the row, as Mllama does.
    empty = ~visible.any(dim=-1)  # [T]
    out = torch_grouped_attention(q, k, v, visible | empty[:, None])
    return out.masked_fill(empty[:, None, None], 0.0).to(q.dtype)  # [T, H, E]


# ---- swiglu ----

def swiglu(gate, up):
    if uses_triton(gate):
        F_ = gate.shape[-1]
        return swiglu_fwd(_rows(gate).reshape(-1, F_), _rows(up).reshape(-1, F_)).reshape(gate.shape)
    return F.silu(gate) * up  # silu rounded to the dtype, then the product (HF's LlamaMLP order)


def swiglu_gate_up(gate_up):
    """gate_up [T, 2F] (gate = first F columns, up = last F) -> silu(gate) · up, [T, F]."""
    if uses_triton(gate_up):
        return swiglu_gate_up_fwd(_rows(gate_up))
    return torch_swiglu_gate_up(gate_up)


def torch_swiglu_gate_up(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)  # [T, 2F] -> 2 × [T, F]
    return F.silu(gate) * up


# ---- lora ----

def lora_merge(weight, lora_a, lora_b, scale):
    delta = lora_b.float() @ lora_a.float()  # [Dout, R] @ [R, Din] -> [Dout, Din], fp32 (bf16 would round twice)
    return (weight.float() + float(scale) * delta).to(weight.dtype)
