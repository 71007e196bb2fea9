"""A plain weight tensor's products in the decode step: the dense twin of accel.quant_ops.QuantTensor's methods.

The fused ops of accel.ops.fused take a weight matrix of either kind and call one method on it (`fused.matrix`):
a quantized matrix carries its own kernels (the quantized GEMVs), a plain tensor is wrapped here to reach the dense
ones (accel/kernels/gemv.py, qkv_rope.py) or, without Triton, their torch versions. Contracts: fused_interface.py.
"""
from __future__ import annotations

import torch

from ..kernels.gemv import gemv_fwd
from ..kernels.qkv_rope import qkv_rope_fwd
from ..kernels.tuning import DEFAULT, Tuning
from .dispatch import uses_triton
from .torch_ops import torch_linear_add, torch_norm_linear, torch_qkv_rope, torch_swiglu_linear_add


class DenseMatrix:
    """weight [N, K], a plain tensor, with the decode step's products as methods (QuantTensor's names)."""

    __slots__ = ("weight",)

    def __init__(self, weight: torch.Tensor):
        self.weight = weight

    def qkv_rope(self, x, norm_weight, eps, cos, sin, position, cache_k, cache_v, tuning: Tuning = DEFAULT):
        if uses_triton(x):
            return qkv_rope_fwd(self.weight, x, norm_weight, eps, cos, sin, position, cache_k, cache_v,
                                table=tuning.qkv_rope)
        return torch_qkv_rope(x, norm_weight, self.weight, eps, cos, sin, position, cache_k, cache_v)

    def norm_linear(self, x, norm_weight, eps, tuning: Tuning = DEFAULT):
        if uses_triton(x):
            return gemv_fwd(self.weight, x, norm_weight=norm_weight, eps=eps, table=tuning.gemv)
        return torch_norm_linear(x, norm_weight, self.weight, eps)

    def linear_add(self, a, residual, tuning: Tuning = DEFAULT, gate=None, accumulate: bool = True):
        if uses_triton(a):
            return gemv_fwd(self.weight, a, residual=residual if accumulate else None, gate=gate, out=residual,
                            table=tuning.gemv)
        return torch_linear_add(a, self.weight, residual, gate, accumulate)

    def swiglu_linear_add(self, gate_up, residual, tuning: Tuning = DEFAULT, gate=None, accumulate: bool = True):
        if uses_triton(gate_up):
            return gemv_fwd(self.weight, gate_up, swiglu=True, residual=residual if accumulate else None, gate=gate,
                            out=residual, table=tuning.gemv)
        return torch_swiglu_linear_add(gate_up, self.weight, residual, gate, accumulate)

    def norm_mlp_add(self, x, norm_weight, down, eps, tuning: Tuning = DEFAULT, accumulate: bool = True):
        """With this gate_up and `down` (a matrix of either kind): the SwiGLU in down's prologue."""
        return down.swiglu_linear_add(self.norm_linear(x, norm_weight, eps, tuning), x, tuning,
                                      accumulate=accumulate)
