"""Attention for training: `flash_attention(q, k, v, causal, mask)`, differentiable, GQA-native.

On CUDA (and on CPU under TRITON_INTERPRET=1) forward and backward are the Triton kernels of
accel/kernels/flash_attn_train.py: the forward saves only o and the log-sum-exp, the backward recomputes the
probabilities blockwise. On CPU without the interpreter the same math runs in plain torch (fp32 softmax), and
torch's autograd differentiates it.
"""
from __future__ import annotations

import math
import os

import torch

from accel.kernels.flash_attn_train import flash_attn_bwd, flash_attn_train_fwd


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                    mask: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, T, H, E], k/v [B, S, K, E] (H % K == 0; query head h reads kv head h // (H/K)), mask [B, T, S] bool
    (True = may attend; combined with the causal mask) or None -> o [B, T, H, E] in q's dtype. Scale 1/sqrt(E);
    causal means key s is visible to query t iff s <= t (top-left aligned, as torch SDPA's is_causal).
    A query row that sees no key (all masked: padding) outputs 0, and every gradient through it is 0.
    Scores and softmax are computed in fp32 whatever the input dtype. E <= 128."""
    if q.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":
        return _FlashAttention.apply(q, k, v, causal, mask)
    return attention_reference(q, k, v, causal, mask)


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, mask):
        q, k, v = (x if x.stride(3) == 1 else x.contiguous() for x in (q, k, v))
        o, lse = flash_attn_train_fwd(q, k, v, causal, mask)
        ctx.save_for_backward(q, k, v, o, lse, mask)
        ctx.causal = causal
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, mask = ctx.saved_tensors
        dq, dk, dv = flash_attn_bwd(q, k, v, o, lse, do, ctx.causal, mask)
        return dq, dk, dv, None, None


def visible_keys(T: int, S: int, causal: bool, mask: torch.Tensor | None, device) -> torch.Tensor:
    """[B or 1, T, S] bool: which keys each query may attend (causal top-left, and the mask)."""
    vis = torch.ones(1, T, S, dtype=torch.bool, device=device)
    if causal:
        vis = torch.tril(vis)
    return vis if mask is None else vis & mask


def attention_reference(q, k, v, causal: bool = True, mask=None) -> torch.Tensor:
    """flash_attention's math in plain torch (differentiable by autograd): scores and softmax in fp32 (fp64 inputs:
    fp64)."""
    B, T, H, E = q.shape
    S, NK = k.shape[1], k.shape[2]
    ct = torch.promote_types(q.dtype, torch.float32)  # fp32 math for bf16 / fp32, fp64 stays fp64 (gradcheck)
    qf = q.to(ct).transpose(1, 2)  # [B, T, H, E] -> [B, H, T, E]
    kf = k.to(ct).transpose(1, 2).repeat_interleave(H // NK, dim=1)  # [B, S, K, E] -> [B, H, S, E]
    vf = v.to(ct).transpose(1, 2).repeat_interleave(H // NK, dim=1)
    scores = qf @ kf.transpose(2, 3) / math.sqrt(E)  # [B, H, T, E] @ [B, H, E, S] -> [B, H, T, S]
    vis = visible_keys(T, S, causal, mask, q.device)[:, None]  # [B, 1, T, S]
    empty = ~vis.any(dim=-1, keepdim=True)  # [B, 1, T, 1]: rows that see nothing attend everywhere, then get 0
    p = torch.softmax(scores.masked_fill(~(vis | empty), float("-inf")), dim=-1)
    p = p.masked_fill(empty, 0.0)
    out = p @ vf  # [B, H, T, S] @ [B, H, S, E] -> [B, H, T, E]
    return out.transpose(1, 2).to(q.dtype)  # -> [B, T, H, E]
