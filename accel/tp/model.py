"""One rank's forward over its shard (accel.tp.shard), with the collectives Megatron's split needs.

Per layer, on the residual stream x [T, D] (whole on every rank):
    h = rms_norm(x)                                   replicated
    qkv = h · qkv_rᵀ                                  [T, (H+2K)/N·E]: this rank's heads (column-parallel)
    a = attention(rope(q), cache_r)                   [T, H/N, E] over this rank's KV heads' cache
    x += all_reduce(a · o_rᵀ)                         row-parallel: each rank's product is a partial sum
    x += all_reduce(swiglu(h · gate_up_rᵀ) · down_rᵀ) the same for the MLP
The embedding is vocab-parallel: a rank looks up the ids its rows hold (zero for the others) and the rows are
all-reduced; the logits [1, ceil(V/N)] of every rank are all-gathered into [1, V].

`forward` is the eager path: accel.ops (Triton kernels on CUDA, their torch versions elsewhere), what a prompt
runs. A decoded token runs accel.model.decode_step, the one-GPU engine's fused step, over the rank's shard with
`RankSplit`'s collectives (accel.tp.engine captures it in a CUDA graph on the GPU, the collectives inside): the
rank owning the residual stream (rank 0) adds its o and down products into x in the GEMVs' epilogues, the others
write theirs into x, and one all-reduce of x gives every rank x + Σ partials.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from refimpl.model.config import LlamaConfig

from .. import ops
from ..ops.torch_ops import split_qkv
from ..weights import Weights


@dataclass
class ShardCache:
    k: torch.Tensor  # [L, K/N, S, E]
    v: torch.Tensor  # [L, K/N, S, E]
    cos: torch.Tensor  # [S, E/2] fp32
    sin: torch.Tensor  # [S, E/2] fp32
    slots: torch.Tensor  # [S] int64, 0..S-1

    @property
    def capacity(self) -> int:
        return self.k.shape[2]


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(x)  # sum over the ranks, in place
    return x


def embed_rows(table: torch.Tensor, ids: torch.Tensor, first_id: int) -> torch.Tensor:
    """ids [T] -> [T, D]: this rank's rows (token ids first_id..) looked up, zero for the others' ids (summed over
    the ranks: the embedding)."""
    local = ids - first_id  # [T]
    mine = (local >= 0) & (local < table.shape[0])  # [T]
    x = table[local.clamp(0, table.shape[0] - 1)]  # [Vr, D][T] -> [T, D]
    return x * mine[:, None].to(x.dtype)


# one flat output (no per-rank list to copy out); torch 2.13 renamed all_gather_into_tensor all_gather_single
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def gather_logits(local: torch.Tensor, world: int, vocab_size: int) -> torch.Tensor:
    """Every rank's logits [1, ceil(V/N)] -> [1, V], the same on every rank."""
    out = torch.empty(world, local.shape[1], dtype=local.dtype, device=local.device)  # [N, ceil(V/N)]
    _all_gather_flat(out, local)
    return out.reshape(1, -1)[:, :vocab_size]  # [1, N·ceil(V/N)] -> [1, V]


class RankSplit:
    """accel.model.decode_step's hooks on one rank (accel.model.WholeModel's counterpart): the vocab-parallel
    embedding, the all-reduce of the residual stream after o and down, the logits gathered."""

    def __init__(self, rank: int, world: int, first_id: int, vocab_size: int):
        self.owner = rank == 0  # rank 0's o/down products add to x; the other ranks' overwrite it
        self.world, self.first_id, self.vocab_size = world, first_id, vocab_size

    def embedding(self, token, table):
        x = embed_rows(table, token, self.first_id)  # [1, D]
        self.reduce(x)
        return x

    @staticmethod
    def reduce(x) -> None:
        """x [1, D] summed over the ranks, in place."""
        all_reduce(x)

    def gather(self, logits):
        return gather_logits(logits, self.world, self.vocab_size)


def layer(lw, cfg: LlamaConfig, x, cache_k, cache_v, cos, sin, positions):
    """One decoder layer of this rank's shard (cfg: the rank's local config) -> the new residual stream x [T, D]."""
    T, eps = x.shape[0], cfg.rms_norm_eps
    H, K, E = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    h = ops.rms_norm(x, lw.attn_norm, eps)  # [T, D]
    qkv = ops.linear(h, lw.qkv)  # [T, D] -> [T, (H+2K)·E]
    q, k, v = split_qkv(qkv, H, K, E)
    q_rot = ops.rope_kv_write(q, k, v, cos, sin, cache_k, cache_v, positions)  # k_rot, v -> cache
    a = ops.causal_attention(q_rot, cache_k, cache_v, positions).reshape(T, H * E)  # [T, H, E] -> [T, H·E]
    x = x + all_reduce(ops.linear(a, lw.o))  # [T, H·E] -> [T, D] partial, summed over ranks
    h = ops.rms_norm(x, lw.mlp_norm, eps)
    act = ops.swiglu_gate_up(ops.linear(h, lw.gate_up))  # [T, D] -> [T, 2F] -> [T, F]
    return x + all_reduce(ops.linear(act, lw.down))  # [T, F] -> [T, D] partial, summed over ranks


def forward(w: Weights, cfg: LlamaConfig, vocab_size: int, first_id: int, world: int, ids: torch.Tensor,
            start: int, cache: ShardCache) -> torch.Tensor:
    """ids [T] at positions start..start+T-1 (written into the cache) -> the last token's logits [1, V], the same
    on every rank. cfg: the rank's local config; first_id: the first token id of its embedding rows."""
    T = ids.shape[0]
    positions = cache.slots[start:start + T]  # [T]
    cos, sin = cache.cos[start:start + T], cache.sin[start:start + T]  # [T, E/2]
    x = all_reduce(embed_rows(w.embed, ids, first_id))
    for i, lw in enumerate(w.layers):
        x = layer(lw, cfg, x, cache.k[i], cache.v[i], cos, sin, positions)
    h = ops.rms_norm(x[-1:], w.norm, cfg.rms_norm_eps)  # [1, D]
    return gather_logits(ops.linear(h, w.lm_head), world, vocab_size)  # [1, D] -> [1, ceil(V/N)] -> [1, V]
