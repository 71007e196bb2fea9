"""The batch engine's ops (accel.batch), each a Triton kernel or its torch version, picked by accel/ops/dispatch.py:
the paged decode attention (accel/kernels/paged_attn.py), the batched linear layers and their batch-invariant version
(accel/kernels/matmul.py), the gate_up GEMM with SwiGLU in its epilogue (the same kernel), the greedy tokens of a
batch of logits rows (accel/kernels/argmax.py).
With `invariant`, the torch versions run one row at a time: every row then takes the same path whatever the batch."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..kernels.argmax import argmax_rows_fwd
from ..kernels.matmul import (invariant_matmul_fwd, invariant_swiglu_matmul_fwd, matmul_fwd, row_bucket,
                              swiglu_matmul_fwd)
from ..kernels.paged_attn import paged_decode_attention_fwd
from ..kernels.tuning import MATMUL, SWIGLU_MATMUL
from .dispatch import rows, uses_triton
from .fused import swiglu_gate_up


def paged_decode_attention(q, cache_k, cache_v, tables, lens, block_size: int, invariant: bool = False, out=None):
    """q [B, H, E] (one new token per sequence), cache_k/cache_v [K, S, E] slot pools, tables [B, W] int32 block
    tables, lens [B] int32 (sequence b sees its positions 0..lens[b]-1) -> [B, H, E] in q's dtype, written into
    `out` where given (the kernel writes it directly: no copy). `invariant`: the kernel's fixed-length splits
    (each row's bits its own), the torch version's row-at-a-time path; else the kernel cuts each sequence into a
    number of equal splits chosen for B (accel/kernels/paged_attn.py)."""
    if uses_triton(q):
        return paged_decode_attention_fwd(rows(q), cache_k, cache_v, tables, lens, block_size, out=out,
                                          even=not invariant)
    if invariant:  # each row over exactly its own blocks (eager: the lengths come to the host)
        a = torch.cat([torch_paged_decode_attention(q[b:b + 1], cache_k, cache_v,
                                                    tables[b:b + 1, :max(1, -(-int(n) // block_size))],
                                                    lens[b:b + 1], block_size) for b, n in enumerate(lens.tolist())])
    else:
        a = torch_paged_decode_attention(q, cache_k, cache_v, tables, lens, block_size)
    return a if out is None else out.copy_(a)


def batched_linear(x, weight, table=MATMUL):
    """x [T, Din] @ weight [Dout, Din]ᵀ -> [T, Dout]: the weight-streaming kernel where `table` (accel/kernels/
    tuning.py's MATMUL: where it measured faster) lists the weight's shape at T's row bucket, else cuBLAS."""
    if uses_triton(x) and x.shape[0]:
        cfg = table.get((weight.shape[0], weight.shape[1], row_bucket(x.shape[0])))
        if cfg is not None:
            return matmul_fwd(rows(x), rows(weight), cfg)
    return F.linear(x, weight)


def batched_swiglu_linear(x, gate_up, table=SWIGLU_MATMUL, linear_table=MATMUL):
    """x [T, Din], gate_up [2F, Din] -> silu(x @ gateᵀ) · (x @ upᵀ) [T, F]: the fused kernel where `table`
    (tuning.py's SWIGLU_MATMUL) lists the weight's shape at T's row bucket, else batched_linear then SwiGLU."""
    if uses_triton(x) and x.shape[0]:
        cfg = table.get((gate_up.shape[0], gate_up.shape[1], row_bucket(x.shape[0])))
        if cfg is not None:
            return swiglu_matmul_fwd(rows(x), rows(gate_up), cfg)
    return swiglu_gate_up(batched_linear(x, gate_up, linear_table))


def invariant_swiglu_linear(x, gate_up):
    """invariant_linear then SwiGLU -> [T, F], in one kernel under Triton (the same bits as the two)."""
    if uses_triton(x) and x.shape[0]:
        return invariant_swiglu_matmul_fwd(rows(x), rows(gate_up))
    return swiglu_gate_up(invariant_linear(x, gate_up))


def invariant_linear(x, weight):
    """x [T, Din] @ weight [Dout, Din]ᵀ -> [T, Dout], each row's bits independent of T (one tiling for every T; the
    torch version: one row at a time)."""
    if uses_triton(x):
        return invariant_matmul_fwd(rows(x), rows(weight))
    return torch.cat([F.linear(x[t:t + 1], weight) for t in range(x.shape[0])] + [x.new_empty(0, weight.shape[0])])


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


def greedy_rows(logits, out=None):
    """logits [R, V] -> [2, R] int64 (into `out` where given): row 0 each row's greedy token (the first index of its
    maximum, as torch.argmax), row 1 1 where all the row's logits are finite, else 0."""
    if uses_triton(logits) and logits.stride(-1) == 1:
        return argmax_rows_fwd(logits, out)
    head = torch.stack([torch.argmax(logits, dim=-1), torch.isfinite(logits).all(dim=-1).to(torch.int64)])
    return head if out is None else out.copy_(head)
