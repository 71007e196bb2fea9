"""LoRA on torch: the trainable adapter state and the training layers' linear with its LoRA pair (`lora_linear`
here returns x·Aᵀ too, for a hand-written backward; the op interface's unmerged `lora_linear` is accel.ops').

x @ Wᵀ + scale · (dropout(x) @ Aᵀ) @ Bᵀ with W frozen in the model dtype and A, B trainable fp32 masters.

The trainer's base GEMMs are fused (qkv, gate_up), so their LoRA pairs are grouped too (`lora_group`): the A's
stacked into one [ΣR, Din] matrix (one thin GEMM for q, k and v together) and the scaled B's into one block-diagonal
[ΣDout, ΣR] matrix, whose product lands on the fused output in one GEMM that accumulates into it (`adapted_linear`).
The branch computes in `dtype`: the model dtype by default (bf16 tensor-core GEMMs; the copies of A and B are cast
from the fp32 masters each step, so gradients and optimiser state stay fp32), or fp32 as PEFT does.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from refimpl.formats.lora_targets import LLAMA_LINEARS


@dataclass
class LoraModule:
    """One adapted linear: `name` is PEFT's module name (model.layers.3.self_attn.q_proj)."""

    name: str
    a: torch.nn.Parameter  # [R, Din] fp32
    b: torch.nn.Parameter  # [Dout, R] fp32
    scale: float


def module_name(param_name: str) -> str:
    return param_name.removesuffix(".weight")


def weight_name(layer: int, linear: str) -> str:
    """(3, 'q_proj') -> 'model.layers.3.self_attn.q_proj.weight'."""
    return f"model.layers.{layer}.{'self_attn' if linear in LLAMA_LINEARS[:4] else 'mlp'}.{linear}.weight"


def target_names(cfg, targets: tuple[str, ...]) -> list[str]:
    """Checkpoint weight names of every linear whose short name (q_proj, ...) is in `targets`, in layer order."""
    return [weight_name(i, t) for i in range(cfg.num_hidden_layers) for t in LLAMA_LINEARS if t in targets]


def init_lora(shapes: dict, names: list[str], rank: int, scale: float, seed: int,
              name_of=module_name) -> dict[str, LoraModule]:
    """PEFT's default initialisation: A ~ kaiming_uniform(a=√5) = U(±1/√Din), B = 0 (the adapter starts a no-op).
    name_of: a weight's name -> its module's name in PEFT's files."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name in names:
        d_out, d_in = shapes[name]
        bound = 1.0 / math.sqrt(d_in)
        a = (torch.rand(rank, d_in, generator=gen, dtype=torch.float32) * 2 - 1) * bound
        out[name] = LoraModule(name_of(name), torch.nn.Parameter(a),
                               torch.nn.Parameter(torch.zeros(d_out, rank)), scale)
    return out


def from_adapter(adapter, name_of=module_name) -> dict[str, LoraModule]:
    """refimpl.formats.lora.load_lora's [(name, A, B, scale)] -> trainable fp32 modules (name_of: as init_lora)."""
    return {name: LoraModule(name_of(name), torch.nn.Parameter(torch.from_numpy(a.copy())),
                             torch.nn.Parameter(torch.from_numpy(b.copy())), scale)
            for name, a, b, scale in adapter}


class LoraGroup(NamedTuple):
    """The LoRA pairs of one fused linear, ready for `adapted_linear` (built each step from the fp32 masters)."""

    a: torch.Tensor  # [ΣR, Din] in the compute dtype: the present modules' A's stacked
    b: torch.Tensor  # [ΣDout, ΣR] in the compute dtype: block-diagonal, each block scale · B (zeros: no adapter)
    ranks: tuple[int, ...]  # R of each present module, the row blocks of `a`


def lora_group(adapters, outs, dtype) -> LoraGroup | None:
    """adapters: one (A, B, scale) or None per slice of a fused linear, outs: each slice's Dout -> LoraGroup, or
    None when no slice is adapted."""
    present = [a for a in adapters if a is not None]
    if not present:
        return None
    ranks = tuple(m[0].shape[0] for m in present)
    a = (torch.cat([m[0] for m in present]) if len(present) > 1 else present[0][0]).to(dtype)  # [ΣR, Din]
    if len(adapters) == 1:
        return LoraGroup(a, (present[0][1] * present[0][2]).to(dtype), ranks)
    # few ops a step (the host, not the GPU, bounds an eager step): one scale multiply when the scales agree
    one_scale = len({m[2] for m in present}) == 1
    blocks = [(m[1] if one_scale else m[1] * m[2]) if m is not None else present[0][1].new_zeros(n, 0)
              for m, n in zip(adapters, outs)]  # [Dout_i, R_i] each, [Dout_i, 0] where not adapted
    b = torch.block_diag(*blocks)  # [ΣDout, ΣR]
    return LoraGroup(a, (b * present[0][2] if one_scale else b).to(dtype), ranks)


def _accumulate(out, xa, b):
    """out [.., Dout] + xa [.., ΣR] @ bᵀ [ΣR, Dout]: the second GEMM adds the base output in its epilogue
    (beta = 1)."""
    return torch.addmm(out.view(-1, out.shape[-1]), xa.reshape(-1, xa.shape[-1]), b.t()).view(out.shape)


def dropout_masks(x, p: float, count: int) -> list[torch.Tensor]:
    """`count` independent inverted-dropout masks shaped and typed as x: each element 0 with probability p, else
    1/(1-p) (F.dropout's scaling). PEFT drops the input of each module's lora_A with its own mask; x · mask is
    that dropped input."""
    return [torch.empty_like(x).bernoulli_(1 - p).div_(1 - p) for _ in range(count)]


def dropped_xa(x, a, ranks: tuple[int, ...], masks: list) -> torch.Tensor:
    """x [.., Din] -> [.., ΣR]: module i's rows of the stacked a [ΣR, Din] applied to x · masks[i] (its own dropped
    input), or all of a to x itself without masks."""
    if not masks:
        return F.linear(x, a)  # [.., Din] -> [.., ΣR]
    return torch.cat([F.linear(x * m, a_i) for m, a_i in zip(masks, a.split(ranks))], dim=-1)


def lora_linear(x, weight, a=None, b=None, ranks=(), masks=()):
    """x [.., Din] @ weightᵀ + (dropped x @ aᵀ) @ bᵀ, all in x's dtype -> (y [.., Dout], the LoRA input
    x @ aᵀ [.., ΣR]) — kept for a hand-written backward — or (y, None) without a pair. masks (dropout_masks, one
    per module of `ranks`): each module's dropout on x; none: no dropout."""
    out = F.linear(x, weight)  # [.., Din] -> [.., Dout]
    if a is None:
        return out, None
    xa = dropped_xa(x, a, ranks, masks)
    return _accumulate(out, xa, b), xa


def adapted_linear(x, weight, group: LoraGroup | None, dropout: float = 0.0):
    """x [.., Din] @ weightᵀ [Din, Dout] + the group's LoRA term -> [.., Dout] in x's dtype. With dropout, each
    module draws its own mask (as PEFT's separate modules do; dropout_masks)."""
    if group is None:
        return F.linear(x, weight)
    xc = x.to(group.a.dtype)
    masks = dropout_masks(xc, dropout, len(group.ranks)) if dropout else []
    if group.a.dtype == x.dtype:
        return lora_linear(x, weight, group.a, group.b, group.ranks, masks)[0]
    out = F.linear(x, weight)  # [.., Din] -> [.., Dout]
    xa = dropped_xa(xc, group.a, group.ranks, masks)  # [.., Din] -> [.., ΣR]
    return (out + F.linear(xa, group.b)).to(out.dtype)  # [.., ΣR] -> [.., Dout], summed in fp32 as PEFT does
