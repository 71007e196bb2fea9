"""The vision ops of the op interface (`refimpl.model.interface.VisionOps`) on torch tensors, any device.

Plain torch for now: the vision encoder runs once per image. Each op reduces in fp32 and returns the input dtype.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def layer_norm(x, weight, bias, eps):
    out = F.layer_norm(x.float(), (x.shape[-1],), weight.float(), bias.float(), eps)  # [..., U]
    return out.to(x.dtype)


def gelu(x):
    return F.gelu(x)  # approximate="none": the erf form, HF's ACT2FN["gelu"]


def encoder_attention(q, k, v, mask=None):
    L, H, E = q.shape
    K = k.shape[1]
    qf = q.float().transpose(0, 1)  # [L, H, E] -> [H, L, E]
    kf = k.float().transpose(0, 1).repeat_interleave(H // K, dim=0)  # [L, K, E] -> [H, L, E]
    vf = v.float().transpose(0, 1).repeat_interleave(H // K, dim=0)  # [L, K, E] -> [H, L, E]
    scores = qf @ kf.transpose(-1, -2) / math.sqrt(E)  # [H, L, E] @ [H, E, L] -> [H, L, L]
    if mask is not None:
        scores = scores.masked_fill(~torch.as_tensor(mask, device=q.device).bool(), float("-inf"))
    out = torch.softmax(scores, dim=-1) @ vf  # [H, L, L] @ [H, L, E] -> [H, L, E]
    return out.transpose(0, 1).to(q.dtype)  # [H, L, E] -> [L, H, E]
