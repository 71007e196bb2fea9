"""A rank's forward op by op, every activation whole on rank 0: what `llama32 diff --tp N` compares.

The same split as accel.tp.model.layer (Megatron's), yielding refimpl.model.names' activations in their order.
What a rank holds a slice of is gathered from every rank first: the heads of q, k, v, their rotations and the
attention's output (ranks in head order; a KV head replicated on N/K ranks taken once), the MLP's hidden units
(gate, up, act), the logits' vocabulary rows. The o and down products are the all-reduced sums, the residual
stream and the norms are whole on every rank already. Every rank runs `trace` in step (its collectives); rank 0
keeps the list.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from refimpl.model.config import LlamaConfig

from .. import ops
from ..ops.torch_ops import split_qkv
from ..weights import Weights
from .model import ShardCache, all_reduce, embed_rows
from .shard import ShardPlan


def gather(part: torch.Tensor, dim: int, world: int, take=None) -> torch.Tensor:
    """Every rank's slice along dim, concatenated in rank order (take: the ranks kept, default all)."""
    parts = [torch.empty_like(part) for _ in range(world)]
    dist.all_gather(parts, part.contiguous())
    return torch.cat([parts[r] for r in (take or range(world))], dim=dim)


def kv_ranks(plan: ShardPlan) -> list[int]:
    """The ranks whose KV heads, in rank order, are each head once: all of them, or one of each N/K replicas."""
    K, N = plan.cfg.num_key_value_heads, plan.world
    return list(range(N)) if K % N == 0 else [k * N // K for k in range(K)]


def layer_steps(plan: ShardPlan, i: int, lw, x, cache_k, cache_v, cos, sin, positions):
    """accel.tp.model.layer, yielding (name, whole activation) -> the new residual stream x [T, D]."""
    c, N, kv = plan.local, plan.world, kv_ranks(plan)
    T, H, K, E, eps = x.shape[0], c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps
    p = f"layers.{i}."
    h = ops.rms_norm(x, lw.attn_norm, eps)  # [T, D]
    yield p + "attn_norm", h
    q, k, v = split_qkv(ops.linear(h, lw.qkv), H, K, E)  # [T, (H+2K)/N·E] -> [T, H/N, E], [T, K/N, E] ×2
    yield p + "attn.q", gather(q, 1, N)
    yield p + "attn.k", gather(k, 1, N, kv)
    yield p + "attn.v", gather(v, 1, N, kv)
    q_rot = ops.rope_kv_write(q, k, v, cos, sin, cache_k, cache_v, positions)  # k_rot, v -> the cache
    yield p + "attn.q_rot", gather(q_rot, 1, N)
    yield p + "attn.k_rot", gather(cache_k[:, positions].transpose(0, 1), 1, N, kv)  # [K/N, T, E] -> [T, K/N, E]
    a = ops.causal_attention(q_rot, cache_k, cache_v, positions)  # [T, H/N, E]
    yield p + "attn.out", gather(a, 1, N)
    o = all_reduce(ops.linear(a.reshape(T, H * E), lw.o))  # [T, H/N·E] -> [T, D], summed over ranks
    yield p + "attn.o_proj", o
    x = x + o
    yield p + "resid_mid", x
    h = ops.rms_norm(x, lw.mlp_norm, eps)
    yield p + "mlp_norm", h
    gate_up = ops.linear(h, lw.gate_up)  # [T, D] -> [T, 2F/N]: gate, then up
    F = gate_up.shape[1] // 2
    yield p + "mlp.gate", gather(gate_up[:, :F], 1, N)
    yield p + "mlp.up", gather(gate_up[:, F:], 1, N)
    act = ops.swiglu_gate_up(gate_up)  # [T, F/N]
    yield p + "mlp.act", gather(act, 1, N)
    down = all_reduce(ops.linear(act, lw.down))  # [T, F/N] -> [T, D], summed over ranks
    yield p + "mlp.down", down
    x = x + down
    yield p + "resid_post", x
    return x


def forward_steps(plan: ShardPlan, w: Weights, ids: torch.Tensor, start: int, cache: ShardCache):
    """ids [T] at positions start..start+T-1 (into the cache) -> yields (name, whole activation) and returns the
    logits [T, V]."""
    cfg: LlamaConfig = plan.cfg
    T = ids.shape[0]
    positions = cache.slots[start:start + T]  # [T]
    cos, sin = cache.cos[start:start + T], cache.sin[start:start + T]  # [T, E/2]
    x = all_reduce(embed_rows(w.embed, ids, plan.vocab_range()[0]))  # [T, D]
    yield "embed", x
    for i, lw in enumerate(w.layers):
        x = yield from layer_steps(plan, i, lw, x, cache.k[i], cache.v[i], cos, sin, positions)
    h = ops.rms_norm(x, w.norm, cfg.rms_norm_eps)  # [T, D]
    yield "final_norm", h
    logits = gather(ops.linear(h, w.lm_head), 1, plan.world)[:, :cfg.vocab_size]  # [T, N·ceil(V/N)] -> [T, V]
    yield "logits", logits
    return logits


def trace(plan: ShardPlan, w: Weights, ids: torch.Tensor, start: int, cache: ShardCache) -> list:
    """Every rank: the whole forward; -> [(name, activation)] (rank 0's are what `diff` compares)."""
    return list(forward_steps(plan, w, ids, start, cache))
