"""PEFT's LoRA Linear as one autograd Function: the base GEMM and the adapter branch in the activations' dtype,
forward and backward, for accel.hf.apply(lora=True).

    y = x·Wᵀ (+ bias) + s·(x·Aᵀ)·Bᵀ      x [N, Din], W [Dout, Din] frozen, A [R, Din], B [Dout, R] (PEFT keeps them
                                          fp32; cast to x's dtype each call, as torch.autocast would run them)

PEFT's own forward upcasts x and runs the branch in fp32 (fp32 GEMMs off the tensor cores, a [N, Dout] fp32 sum and
a cast back); here the branch accumulates into the base output (one addmm), and the backward is written out: dx =
dy·W + s·(dy·B)·A (one addmm again), dA = s·(dy·B)ᵀ·x, dB = s·dyᵀ·(x·Aᵀ), cast to the adapters' dtype. One
Function instead of the ~10 autograd nodes that the same math costs op by op: an HF + PEFT step at batch 1 is
mostly host time. The answers differ from PEFT's by the rounding of the branch in the activations' dtype; in fp32
models they are PEFT's.
"""
from __future__ import annotations

import torch


class _LoraLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, a, b, scaling: float):
        x2 = x.reshape(-1, x.shape[-1])  # [N, Din]
        ac, bc = a.to(x.dtype), b.to(x.dtype)  # [R, Din], [Dout, R]
        xa = x2 @ ac.t()  # [N, Din] @ [Din, R] -> [N, R]
        y = x2 @ weight.t() if bias is None else torch.addmm(bias, x2, weight.t())  # [N, Dout]
        y.addmm_(xa, bc.t(), alpha=scaling)  # [N, Dout] += s · [N, R] @ [R, Dout]
        ctx.save_for_backward(x2, weight, ac, bc, xa)
        ctx.scaling, ctx.a_dtype, ctx.b_dtype = scaling, a.dtype, b.dtype
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x2, weight, ac, bc, xa = ctx.saved_tensors
        s = ctx.scaling
        dy2 = dy.reshape(-1, dy.shape[-1])  # [N, Dout]
        dyb = dy2 @ bc  # [N, Dout] @ [Dout, R] -> [N, R]
        dx = da = db = None
        if ctx.needs_input_grad[0]:
            dx = (dy2 @ weight).addmm_(dyb, ac, alpha=s)  # [N, Din] = dy·W + s · [N, R] @ [R, Din]
            dx = dx.view(*dy.shape[:-1], x2.shape[-1])
        if ctx.needs_input_grad[3]:
            da = torch.mm(dyb.t(), x2).mul_(s).to(ctx.a_dtype)  # [R, N] @ [N, Din] -> [R, Din]
        if ctx.needs_input_grad[4]:
            db = torch.mm(dy2.t(), xa).mul_(s).to(ctx.b_dtype)  # [Dout, N] @ [N, R] -> [Dout, R]
        return dx, None, None, da, db, None


def lora_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor,
                scaling: float) -> torch.Tensor:
    """x [.., Din], weight [Dout, Din] and bias [Dout] or None (frozen: no gradient), a [R, Din], b [Dout, R]
    -> x·Wᵀ + bias + scaling·(x·Aᵀ)·Bᵀ [.., Dout] in x's dtype; gradients for x, a and b."""
    return _LoraLinear.apply(x, weight, bias, a, b, scaling)


def lora_linear_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """PEFT's LoRA Linear forward through lora_linear. PEFT's forward runs where this does not apply: extra
    arguments, adapters disabled or merged, several active adapters, a variant (DoRA), dropout, a bias on lora_B,
    a base layer that is not a plain nn.Linear (or has hooks, or a trainable weight, or another dtype than x)."""
    names = self.active_adapters
    base = self.base_layer
    if (args or kwargs or self.disable_adapters or self.merged or len(names) != 1 or names[0] not in self.lora_A
            or names[0] in getattr(self, "lora_variant", {}) or self.fan_in_fan_out
            or not isinstance(self.lora_dropout[names[0]], torch.nn.Identity)
            or self.lora_B[names[0]].bias is not None or not _plain_linear(base, x)):
        return type(self).forward(self, x, *args, **kwargs)
    name = names[0]
    return lora_linear(x, base.weight, base.bias, self.lora_A[name].weight, self.lora_B[name].weight,
                       self.scaling[name])


def _plain_linear(base, x: torch.Tensor) -> bool:
    """Whether base(x) is F.linear(x, base.weight, base.bias) with a frozen weight of x's dtype."""
    return (type(base) is torch.nn.Linear and not base._forward_hooks and not base._forward_pre_hooks
            and "forward" not in base.__dict__ and not base.weight.requires_grad and base.weight.dtype == x.dtype
            and (base.bias is None or not base.bias.requires_grad))
