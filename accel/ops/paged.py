"""The paged KV cache's ops (accel.batch): the Triton kernel of accel/kernels/paged_attn.py or its torch version,
picked by accel/ops/dispatch.py."""
from __future__ import annotations

import math

import torch

from ..kernels.paged_attn import paged_decode_attention_fwd
from .dispatch import rows, uses_triton


def paged_decode_attention(q, cache_k, cache_v, tables, lens, block_size: int):
    """q [B, H, E] (one new token per sequence), cache_k/cache_v [K, S, E] slot pools, tables [B, W] int32 block
    tables, lens [B] int32 (sequence b sees its positions 0..lens[b]-1) -> [B, H, E] in q's dtype."""
    if uses_triton(q):
        return paged_decode_attention_fwd(rows(q), cache_k, cache_v, tables, lens, block_size)
    return torch_paged_decode_attention(q, cache_k, cache_v, tables, lens, block_size)


def torch_paged_decode_attention(q, cache_k, cache_v, tables, lens, block_size: int):
    """Gathers each sequence's W·block_size slots through its table and masks positions past its length (no host
    sync, shapes fixed by W: capturable). Scores and softmax in fp32."""
    B, H, E = q.shape
    K = cache_k.shape[0]
    W = tables.shape[1]
    offsets = torch.arange(block_size, device=q.device)
    slots = (tables.long()[:, :, None] * block_size + offsets).reshape(B, W * block_size)  # [B, N]
    visible = torch.arange(W * block_size, device=q.device)[None, :] < lens.long()[:, None]  # [B, N]
    k = cache_k[:, slots].float()  # [K, S, E][:, [B, N]] -> [K, B, N, E]
    v = cache_v[:, slots].float().masked_fill(~visible[None, :, :, None], 0.0)  # unseen slots may hold anything
    qg = q.float().view(B, K, H // K, E)  # [B, H, E] -> [B, K, G, E]
    scores = torch.einsum("bkge,kbne->bkgn", qg, k) / math.sqrt(E)  # [B, K, G, N]
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a length-0 row (padding): zeros, not NaN
    out = torch.einsum("bkgn,kbne->bkge", weights, v)  # [B, K, G, E]
    return out.reshape(B, H, E).to(q.dtype)
