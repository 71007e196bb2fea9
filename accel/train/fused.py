"""Differentiable fused ops of the training forward, each a torch.autograd.Function over Triton kernels:
RMSNorm (accel/kernels/rms_norm.py, forward and backward), RoPE of q and k in one launch (the backward
is the inverse rotation: the same kernel with −sin), SwiGLU over the fused gate_up output (swiglu.py, both ways)
or over separate gate and up outputs (HF's MLP: two linears, either of which PEFT may wrap).

Each saves only its inputs and recomputes the rest in the backward. The frozen tensors (norm weights, cos/sin) get no
gradient. Inputs may carry any leading dims ([B, T, ..]); rows are flattened for the kernels.
"""
from __future__ import annotations

import torch

from accel.kernels.rms_norm import rms_norm_bwd, rms_norm_fwd
from accel.kernels.rope import rope_fwd
from accel.kernels.swiglu import swiglu_bwd, swiglu_fwd, swiglu_gate_up_bwd, swiglu_gate_up_fwd


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[.., D] -> [N, D] with contiguous rows (a view where possible)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        x2 = _rows(x)
        ctx.save_for_backward(x2, weight)
        ctx.eps = eps
        return rms_norm_fwd(x2, weight, eps).view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight = ctx.saved_tensors
        assert not ctx.needs_input_grad[1], "the norm weight is frozen: no weight gradient is computed"
        return rms_norm_bwd(x2, weight, ctx.eps, _rows(dy)).view(dy.shape), None, None


def rope_rows(cos, sin, B: int):
    """cos/sin [T, E/2] (shared by the B sequences) or [B, T, E/2] (positions per sequence) -> [B·T, E/2] each:
    the tables for B sequences flattened into rows."""
    if cos.dim() == 3:
        return cos.reshape(-1, cos.shape[-1]), sin.reshape(-1, sin.shape[-1])
    return (cos.repeat(B, 1), sin.repeat(B, 1)) if B > 1 else (cos, sin)


class _RopeQK(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin):
        B, T, H, E = q.shape
        cos_bt, sin_bt = rope_rows(cos, sin, B)
        ctx.save_for_backward(cos_bt, sin_bt)
        qr, kr = rope_fwd(q.reshape(B * T, H, E), k.reshape(B * T, k.shape[2], E), cos_bt, sin_bt)
        return qr.view(q.shape), kr.view(k.shape)

    @staticmethod
    def backward(ctx, dq, dk):
        cos_bt, sin_bt = ctx.saved_tensors
        shape_q, shape_k = dq.shape, dk.shape
        dq, dk = (d.reshape(-1, *d.shape[2:]) for d in (dq, dk))  # [B, T, H, E] -> [B·T, H, E]
        dq, dk = (d if d.stride(-1) == 1 else d.contiguous() for d in (dq, dk))
        dq, dk = rope_fwd(dq, dk, cos_bt, -sin_bt)  # the inverse rotation
        return dq.view(shape_q), dk.view(shape_k), None, None


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up):
        gu2 = _rows(gate_up)
        ctx.save_for_backward(gu2)
        return swiglu_gate_up_fwd(gu2).view(*gate_up.shape[:-1], gate_up.shape[-1] // 2)

    @staticmethod
    def backward(ctx, dy):
        (gu2,) = ctx.saved_tensors
        return swiglu_gate_up_bwd(gu2, _rows(dy)).view(*dy.shape[:-1], gu2.shape[-1])


class _SwiGLUPair(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        g2, u2 = _rows(gate), _rows(up)
        ctx.save_for_backward(g2, u2)
        return swiglu_fwd(g2, u2).view(gate.shape)

    @staticmethod
    def backward(ctx, dy):
        g2, u2 = ctx.saved_tensors
        dg, du = swiglu_bwd(g2, u2, _rows(dy))
        return dg.view(dy.shape), du.view(dy.shape)


@torch.compiler.disable  # opaque to torch.compile: the kernels are already fused
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [.., D], weight [D] (frozen) -> [.., D] in x's dtype, HF's casting order."""
    return _RMSNorm.apply(x, weight, eps)


@torch.compiler.disable  # opaque to torch.compile: the kernels are already fused
def rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q [B, T, H, E], k [B, T, K, E] (head rows contiguous; strided slices of a fused output are fine),
    cos/sin [T, E/2] or [B, T, E/2] fp32 -> (rotated q, rotated k), new tensors in q's dtype."""
    return _RopeQK.apply(q, k, cos, sin)


@torch.compiler.disable  # opaque to torch.compile: the kernels are already fused
def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [.., 2F] (gate = first F columns) -> silu(gate) · up [.., F]."""
    return _SwiGLU.apply(gate_up)


@torch.compiler.disable  # opaque to torch.compile: the kernels are already fused
def swiglu_pair(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [.., F] (same dtype) -> silu(gate) · up [.., F], HF's rounding order; gradients for both."""
    return _SwiGLUPair.apply(gate, up)
