"""The plain torch version of every op of accel.ops, one each: the path without Triton (a CPU without the
interpreter, or `torch_only()`), written in the kernels' dtype order so that both paths round alike.

None of them syncs with the host or allocates a position-dependent size, except `torch_causal_attention` (prefill,
eager): the decode step built from them is capturable in a CUDA graph like the Triton one.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F


# ---- interface ops ----

def torch_rms_norm(x, weight, eps):
    """HF order: fp32 reduce, cast to x's dtype, then the weight."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # [T, D]
    return (normed.to(x.dtype) * weight).to(x.dtype)


def torch_rotate(x, cos, sin):
    """x [T, H, E] rotated by cos/sin [T, E/2] (HF's rotate_half), in fp32, cast back to x's dtype."""
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]  # [T, H, E] -> 2 × [T, H, E/2]
    c, s = cos[:, None, :], sin[:, None, :]  # [T, E/2] -> [T, 1, E/2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


def torch_swiglu(gate, up):
    return F.silu(gate) * up  # silu rounded to the dtype, then the product (HF's LlamaMLP order)


def torch_grouped_attention(q, k, v, visible):
    """q [T, H, E], k/v [K, N, E], visible [T, N] bool -> [T, H, E] in fp32; every row must see a key."""
    T, H, E = q.shape
    K = k.shape[0]
    qg = q.float().reshape(T, K, H // K, E).permute(1, 2, 0, 3)  # [T, H, E] -> [K, H/K, T, E]
    scores = qg @ k.float()[:, None].transpose(-1, -2) / math.sqrt(E)  # [K, H/K, T, E] @ [K, 1, E, N] -> [K, H/K, T, N]
    scores = scores.masked_fill(~visible, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v.float()[:, None]  # [K, H/K, T, N] @ [K, 1, N, E] -> [K, H/K, T, E]
    return out.permute(2, 0, 1, 3).reshape(T, H, E)  # [K, H/K, T, E] -> [T, H, E]


def torch_layer_norm(x, weight, bias, eps):
    """Reduced in fp32, cast back to x's dtype (what torch's fused LayerNorm kernels do internally)."""
    out = F.layer_norm(x.float(), (x.shape[-1],), weight.float(), bias.float(), eps)  # [..., U]
    return out.to(x.dtype)


def torch_gelu(x):
    return F.gelu(x)  # approximate="none": the erf form, HF's ACT2FN["gelu"]


def torch_encoder_attention(q, k, v, mask=None):
    """q [L, H, E], k/v [L, K, E], mask [L, L] bool or None -> [L, H, E], scores and softmax in fp32."""
    L = q.shape[0]
    visible = (torch.ones((L, L), dtype=torch.bool, device=q.device) if mask is None
               else torch.as_tensor(mask).to(q.device, torch.bool))  # [L, L]
    return torch_grouped_attention(q, k.transpose(0, 1), v.transpose(0, 1), visible).to(q.dtype)  # k/v -> [K, L, E]


def kv_write(k, v, cache_k, cache_v, positions):
    """k/v [T, K, E] into cache_k/cache_v [K, S, E] at `positions` [T] (in place, no host sync)."""
    idx = positions.long()
    cache_k.index_copy_(1, idx, k.transpose(0, 1).to(cache_k.dtype))  # [T, K, E] -> [K, T, E] at positions
    cache_v.index_copy_(1, idx, v.transpose(0, 1).to(cache_v.dtype))


# ---- fused ops ----

def torch_add_rms_norm(x, residual, weight, eps):
    s = x + residual  # rounded to the activation dtype, as the unfused model does
    return s, torch_rms_norm(s, weight, eps)


def torch_embedding_rms_norm(ids, table, weight, eps):
    x = table[ids]  # [V, D][T] -> [T, D]
    return x, torch_rms_norm(x, weight, eps)


def torch_rope_kv_write(q, k, v, cos, sin, cache_k, cache_v, positions):
    kv_write(torch_rotate(k, cos, sin), v, cache_k, cache_v, positions)
    return torch_rotate(q, cos, sin)


def torch_swiglu_gate_up(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)  # [T, 2F] -> 2 × [T, F]
    return torch_swiglu(gate, up)


def torch_causal_attention(q, cache_k, cache_v, positions):
    """Eager: the key count max(positions) + 1 comes to the host, and only those slots are read."""
    n = int(positions.max()) + 1
    visible = torch.arange(n, device=q.device)[None, :] <= positions[:, None]  # [T, n]: causal by absolute position
    return torch_grouped_attention(q, cache_k[:, :n], cache_v[:, :n], visible).to(q.dtype)


def torch_decode_attention(q, cache_k, cache_v, position):
    """q [1, H, E] over slots 0..position of the cache [K, S, E]. Masks the whole capacity S rather than slicing to the
    length: a slice needs the length on the host (a sync) and a new shape each step (no CUDA graph)."""
    visible = torch.arange(cache_k.shape[1], device=q.device)[None, :] <= position.reshape(-1)[:, None]  # [1, S]
    v = cache_v.masked_fill(~visible[0][None, :, None], 0.0)  # slots past the position may hold anything (NaN)
    return torch_grouped_attention(q, cache_k, v, visible).to(q.dtype)


def torch_norm_linear(x, norm_weight, weight, eps):
    return F.linear(torch_rms_norm(x, norm_weight, eps), weight)  # [1, D] -> [1, N]


def torch_linear_add(a, weight, residual, gate=None, accumulate: bool = True):
    """The product is rounded to the dtype before the add, as x + o is (and gate · o before it, with a gate);
    accumulate False: the product overwrites residual."""
    return gated_add(residual, F.linear(a, weight), gate, accumulate)


def torch_swiglu_linear_add(gate_up, weight, residual, gate=None, accumulate: bool = True):
    return gated_add(residual, F.linear(torch_swiglu_gate_up(gate_up), weight), gate, accumulate)


def gated_add(residual, y, gate=None, accumulate: bool = True):
    """residual += [gate ·] y in place (accumulate False: residual = [gate ·] y), each product rounded; returns
    residual. The epilogue of linear_add / swiglu_linear_add, for a product y [1, D] computed before."""
    y = y if gate is None else gate * y
    return residual.add_(y) if accumulate else residual.copy_(y)


def torch_norm_cross_attention(q, norm_weight, eps, keys, values, visible):
    """rms_norm per head, then SDPA (fp32 softmax inside) with the query heads of one kv head folded into the
    query rows (no causal structure to keep), so no kv head is repeated in memory."""
    T, H, E = q.shape
    K = keys.shape[0]
    G = H // K
    qg = torch_rms_norm(q, norm_weight, eps).view(T, K, G, E).permute(1, 2, 0, 3).reshape(1, K, G * T, E)
    mask = visible.to(torch.bool).repeat(G, 1)[None, None]  # [T, N] -> [1, 1, G·T, N]: head k·G+g, row g·T+t
    out = F.scaled_dot_product_attention(qg, keys[None], values[None], attn_mask=mask)  # [1, K, G·T, E]
    return out.view(K, G, T, E).permute(2, 0, 1, 3).reshape(T, H, E)


def split_qkv(qkv, H: int, K: int, E: int):
    """The fused qkv product [T, (H+2K)·E] (accel.weights fuses the rows q, k, v) -> views q [T, H, E], k and v
    [T, K, E]."""
    T = qkv.shape[0]
    return (qkv[:, : H * E].view(T, H, E), qkv[:, H * E: (H + K) * E].view(T, K, E),
            qkv[:, (H + K) * E:].view(T, K, E))


def torch_qkv_rope(x, norm_weight, weight, eps, cos, sin, position, cache_k, cache_v):
    """norm -> qkv -> rope -> cache write as torch_norm_linear, then torch_rope_kv_write at the position's cos/sin
    rows (gathered on the device)."""
    K, _, E = cache_k.shape
    H = weight.shape[0] // E - 2 * K
    qkv = torch_norm_linear(x, norm_weight, weight, eps)  # [1, D] -> [1, (H+2K)·E]
    q, k, v = split_qkv(qkv, H, K, E)
    cos1, sin1 = cos.index_select(0, position), sin.index_select(0, position)  # [S, E/2] -> [1, E/2]
    return torch_rope_kv_write(q, k, v, cos1, sin1, cache_k, cache_v, position)  # k_rot, v -> cache; q_rot


@functools.lru_cache(maxsize=16)
def _row_width(n: int) -> int:
    """A row width near 512 that divides n when one exists (128256 = 256 × 501): no tail to handle."""
    return next((c for c in range(512, 255, -1) if n % c == 0), 512)


def torch_argmax_row(logits):
    """Two stages, the max of each ~512-wide row then of the row maxima: torch's argmax along one long row is a
    single slow reduction. Every index below is a tensor op (gather/where): indexing with a 0-d tensor would call
    .item(), a host sync per token."""
    v = logits.reshape(-1)
    cols = _row_width(v.numel())
    rows = v.numel() // cols
    if rows < 2:
        return torch.argmax(v, dim=0, keepdim=True)
    best, where = v[: rows * cols].view(rows, cols).max(dim=1)  # [rows]: each row's max and first index in it
    r = torch.argmax(best, dim=0, keepdim=True)  # [1]: the first row holding the overall max
    head = r * cols + where.gather(0, r)  # [1]
    if rows * cols == v.numel():
        return head
    tail_max, tail_at = v[rows * cols:].max(dim=0, keepdim=True)  # [1] each; the tail lies after the head,
    return torch.where(tail_max > best.gather(0, r), rows * cols + tail_at, head)  # so it wins only when larger


def torch_greedy_next(logits, token, position, history, step):
    token.copy_(torch_argmax_row(logits))
    history.index_copy_(0, step, token)
    step.add_(1)
    position.add_(1)
    return token


def add_lora(base, x, lora_a, lora_b, scale, dropout: float = 0.0):
    """base [..., Dout] = x @ Wᵀ (however computed: the trainer slices it out of a fused GEMM), x [..., Din] ->
    base + scale · (dropout(x) @ Aᵀ) @ Bᵀ, [..., Dout] in x's dtype; the LoRA branch in A's dtype (fp32)."""
    xa = x.to(lora_a.dtype)
    if dropout:
        xa = F.dropout(xa, dropout, True)
    delta = F.linear(F.linear(xa, lora_a), lora_b)  # [..., Din] -> [..., R] -> [..., Dout]
    return (base + scale * delta).to(x.dtype)
