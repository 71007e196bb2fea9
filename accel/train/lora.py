"""LoRA on torch: the trainable adapter state (the unmerged `lora_linear` op itself is in accel.ops).

x @ Wᵀ + scale · (dropout(x) @ Aᵀ) @ Bᵀ with W frozen in the model dtype and A, B in fp32: the LoRA branch runs in
fp32 (PEFT casts x to the adapter's dtype) and the sum is cast back to x's dtype. Plain torch autograd: the branch is
two thin GEMMs of rank R, whose backward torch already does as well as a kernel would.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


from refimpl.formats.lora import LLAMA_LINEARS


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


def init_lora(shapes: dict, names: list[str], rank: int, scale: float, seed: int) -> dict[str, LoraModule]:
    """PEFT's default initialisation: A ~ kaiming_uniform(a=√5) = U(±1/√Din), B = 0 (the adapter starts a no-op)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name in names:
        d_out, d_in = shapes[name]
        bound = 1.0 / math.sqrt(d_in)
        a = (torch.rand(rank, d_in, generator=gen, dtype=torch.float32) * 2 - 1) * bound
        out[name] = LoraModule(module_name(name), torch.nn.Parameter(a),
                               torch.nn.Parameter(torch.zeros(d_out, rank)), scale)
    return out


def from_adapter(adapter) -> dict[str, LoraModule]:
    """refimpl.formats.lora.load_lora's [(name, A, B, scale)] -> trainable fp32 modules."""
    return {name: LoraModule(module_name(name), torch.nn.Parameter(torch.from_numpy(a.copy())),
                             torch.nn.Parameter(torch.from_numpy(b.copy())), scale)
            for name, a, b, scale in adapter}
