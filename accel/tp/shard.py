"""Megatron-LM's split of a Llama decoder over N ranks, keyed by the checkpoint's parameter names.

    q_proj, k_proj, v_proj   column-parallel: rank r keeps its heads' rows (H/N query heads, K/N KV heads)
    gate_proj, up_proj       column-parallel: rows r·F/N .. (r+1)·F/N
    o_proj, down_proj        row-parallel: the matching columns; each rank's product is a partial sum, all-reduced
    embed_tokens, lm_head    vocab-parallel: ceil(V/N) rows a rank (the last padded with zero rows); a token's
                             embedding is all-reduced from the rank holding it, the logits gathered
    norms                    replicated
Column-parallel q/k/v and gate/up need no communication: each rank's heads and hidden units see the whole input.

KV heads: when N divides K, each rank keeps K/N of them. When K divides N (MQA, or fewer KV heads than ranks), each
KV head is replicated on the N/K ranks whose query heads read it (the query heads of a rank all fall in one group
because H/N divides H/K). Otherwise no rank's query heads would map onto whole KV heads: refused.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from refimpl.errors import ConfigError
from refimpl.formats.params import expected_shapes
from refimpl.model.config import LlamaConfig

VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True)
class Slice:
    """Indices start..stop-1 along dim (0: rows, 1: columns) of a checkpoint matrix; `rows` pads a vocab slice."""

    dim: int
    start: int
    stop: int
    rows: int = 0  # the slice's row count after zero padding (vocab slices); 0: no padding


@dataclass(frozen=True)
class ShardPlan:
    cfg: LlamaConfig  # the whole model's
    rank: int
    world: int

    def __post_init__(self):
        check_divisible(self.cfg, self.world)

    @property
    def local(self) -> LlamaConfig:
        """The config one rank computes with: its heads, KV heads and hidden units (hidden size and vocab whole)."""
        c = self.cfg
        return dataclasses.replace(c, num_attention_heads=c.num_attention_heads // self.world,
                                   num_key_value_heads=max(1, c.num_key_value_heads // self.world),
                                   intermediate_size=c.intermediate_size // self.world, head_dim=c.head_dim)

    @property
    def vocab_rows(self) -> int:
        """Rows of the embedding / lm_head a rank holds: ceil(V/N)."""
        return -(-self.cfg.vocab_size // self.world)

    def vocab_range(self) -> tuple[int, int]:
        """The token ids start..stop-1 this rank's embedding rows hold (stop - start < vocab_rows on a last rank
        padded with zero rows; empty when N exceeds what V fills)."""
        V, n = self.cfg.vocab_size, self.vocab_rows
        return min(self.rank * n, V), min((self.rank + 1) * n, V)

    def kv_heads(self) -> tuple[int, int]:
        """The KV heads start..stop-1 this rank keeps (one replicated head when N is a multiple of K)."""
        K, N = self.cfg.num_key_value_heads, self.world
        if K % N == 0:
            return self.rank * K // N, (self.rank + 1) * K // N
        head = self.rank * K // N
        return head, head + 1

    def slice_of(self, name: str) -> Slice | None:
        """The part of checkpoint tensor `name` this rank keeps; None: the whole tensor (a norm)."""
        c, r, N = self.cfg, self.rank, self.world
        E = c.head_dim
        if name in VOCAB:
            start, stop = self.vocab_range()
            return Slice(0, start, stop, self.vocab_rows)
        suffix = name.split(".", 3)[-1]
        if suffix in ("self_attn.k_proj.weight", "self_attn.v_proj.weight"):
            h0, h1 = self.kv_heads()
            return Slice(0, h0 * E, h1 * E)
        q = c.q_size // N
        F = c.intermediate_size // N
        per = {"self_attn.q_proj.weight": (0, q), "self_attn.o_proj.weight": (1, q),
               "mlp.gate_proj.weight": (0, F), "mlp.up_proj.weight": (0, F), "mlp.down_proj.weight": (1, F)}
        if suffix not in per:
            return None
        dim, n = per[suffix]
        return Slice(dim, r * n, (r + 1) * n)


def shard_elements(plan, shapes: dict | None = None) -> int:
    """The values of every tensor this rank keeps (its slices, padding included, and the replicated ones: the norms,
    a Vision model's encoder). shapes: the checkpoint's {name: shape} (default: a text model's, of plan.cfg)."""
    n = 0
    for name, shape in (expected_shapes(plan.cfg) if shapes is None else shapes).items():
        s = plan.slice_of(name)
        if s is None:
            n += math.prod(shape)
        else:
            kept = s.rows or s.stop - s.start
            n += kept * shape[1] if s.dim == 0 else shape[0] * kept
    return n


def element_bytes(dtype, quant) -> int:
    """Bytes a value of the shard takes at most: the dtype's, or 1 for quantized codes (int8; int4 packs two)."""
    return dtype.itemsize if quant is None else 1


def check_divisible(cfg: LlamaConfig, world: int) -> None:
    """Refuse a split Megatron's scheme cannot make, in one line naming the numbers."""
    H, K, F = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    if world < 1:
        raise ConfigError(f"--tp {world}: expected a positive number of ranks")
    if H % world:
        raise ConfigError(f"--tp {world} does not divide the model's {H} attention heads (num_attention_heads); "
                          f"use a --tp that does")
    if K % world and world % K:
        raise ConfigError(f"--tp {world} and the model's {K} KV heads (num_key_value_heads): neither divides the "
                          f"other, so the KV heads can be neither split nor replicated evenly; use a --tp that "
                          f"divides {K} or is a multiple of it")
    if F % world:
        raise ConfigError(f"--tp {world} does not divide the model's intermediate_size {F}; use a --tp that does")
