"""PEFT's LoRA Linear as one autograd Function: the base GEMM and the adapter branch in the activations' dtype,
forward and backward, for accel.hf.apply(lora=True).

    y = x·Wᵀ (+ bias) + s·(x·Aᵀ)·Bᵀ      x [N, Din], W [Dout, Din] frozen, A [R, Din], B [Dout, R] (PEFT keeps them
                                          fp32; cast to x's dtype once per optimizer step, as torch.autocast would run them)

PEFT's own forward upcasts x and runs the branch in fp32 (fp32 GEMMs off the tensor cores, a [N, Dout] fp32 sum and
a cast back); here the branch accumulates into the base output (one addmm), and the backward is written out: dx =
dy·W + s·(dy·B)·A (one addmm again), dA = s·(dy·B)ᵀ·x, dB = s·dyᵀ·(x·Aᵀ), cast to the adapters' dtype. One
Function instead of the ~10 autograd nodes that the same math costs op by op: an HF + PEFT step at batch 1 is
mostly host time. The answers differ from PEFT's by the rounding of the branch in the activations' dtype; in fp32
models they are PEFT's.
"""
from __future__ import annotations

import weakref

import torch

from accel.hf.memo import version


def project(x2: torch.Tensor, weight, bias, ac, bc, s: float):
    """x2 [N, Din] -> (x2·Wᵀ + bias + s·(x2·Aᵀ)·Bᵀ [N, Dout], x2·Aᵀ [N, R]); without an adapter (ac None):
    (x2·Wᵀ + bias, None). ac [R, Din], bc [Dout, R] in x2's dtype."""
    y = x2 @ weight.t() if bias is None else torch.addmm(bias, x2, weight.t())  # [N, Din] @ [Din, Dout]
    if ac is None:
        return y, None
    xa = x2 @ ac.t()  # [N, Din] @ [Din, R] -> [N, R]
    return y.addmm_(xa, bc.t(), alpha=s), xa  # [N, Dout] += s · [N, R] @ [R, Dout]


def project_backward(dy2: torch.Tensor, x2, xa, weight, ac, bc, s: float, grads_ab: bool, dx=None,
                     into_x: bool = False):
    """project's backward: dy2 [N, Dout] -> (dx [N, Din] (added into `dx` where given; written into x2's buffer
    with `into_x`, where the caller needs x2 no more), (dA [R, Din], dB [Dout, R]) in dy2's dtype, or (None, None)
    without an adapter or where `grads_ab` is False). x2 may be None then."""
    dyb = None if ac is None else dy2 @ bc  # [N, Dout] @ [Dout, R] -> [N, R]
    ab = (None, None)
    if dyb is not None and grads_ab:  # before dx: it may overwrite x2
        ab = (torch.mm(dyb.t(), x2).mul_(s), torch.mm(dy2.t(), xa).mul_(s))  # [R,N]@[N,Din], [Dout,N]@[N,R]
    if dx is not None:
        dx.addmm_(dy2, weight)  # += [N, Dout] @ [Dout, Din]
    else:
        dx = torch.mm(dy2, weight, out=x2) if into_x else dy2 @ weight
    if dyb is not None:
        dx.addmm_(dyb, ac, alpha=s)  # += s · [N, R] @ [R, Din]
    return dx, ab


_casts: dict = {}  # id(a) -> (weakref to a, versions, b, dtype, (a cast, b cast) or None); dropped with a


def casts(a, b, dtype, last: bool = False):
    """The adapters in the activations' dtype (as torch.autocast would run them); (None, None) without one.
    The first call at a version of a and b (their version counters: the optimizer's in-place step bumps them)
    casts without keeping the cast; the second (gradient checkpointing's recompute) keeps it for the calls after,
    and the call with `last` (a backward's) drops it. So a training step keeps no layer's casts while the other
    layers run (the forward's are freed at once; the recompute's live until the layer's backward), and nothing is
    kept from one step to the next; calls without `last` (inference) keep it from their second on."""
    if a is None or (a.dtype == dtype and b.dtype == dtype):
        return a, b
    key, versions = id(a), (version(a), version(b))
    hit = _casts.get(key)
    seen = hit is not None and hit[0]() is a and hit[1] == versions and hit[2] is b and hit[3] == dtype
    pair = hit[4] if seen and hit[4] is not None else (a.detach().to(dtype), b.detach().to(dtype))
    if last:
        _casts.pop(key, None)
    elif not seen or hit[4] is None:
        _casts[key] = (weakref.ref(a, lambda _, key=key: _casts.pop(key, None)), versions, b, dtype,
                       pair if seen else None)
    return pair


class _LoraLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, a, b, scaling: float):
        x2 = x.reshape(-1, x.shape[-1])  # [N, Din]
        y, xa = project(x2, weight, bias, *casts(a, b, x.dtype), scaling)
        ctx.save_for_backward(x2, xa)
        # parameters kept as they are, outside the saved tensors that gradient checkpointing drops and recomputes
        ctx.params, ctx.scaling = (weight, a, b), scaling
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x2, xa = ctx.saved_tensors
        weight, a, b = ctx.params
        dy2 = dy.reshape(-1, dy.shape[-1])  # [N, Dout]
        grads_ab = ctx.needs_input_grad[3] or ctx.needs_input_grad[4]
        ac, bc = casts(a, b, dy.dtype, last=True)
        dx, (da, db) = project_backward(dy2, x2, xa, weight, ac, bc, ctx.scaling, grads_ab)
        dx = dx.view(*dy.shape[:-1], x2.shape[-1]) if ctx.needs_input_grad[0] else None
        if grads_ab:
            da, db = da.to(a.dtype), db.to(b.dtype)
        return dx, None, None, da, db, None


@torch.compiler.disable  # opaque to torch.compile, as accel/train/fused.py's ops
def lora_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor,
                scaling: float) -> torch.Tensor:
    """x [.., Din], weight [Dout, Din] and bias [Dout] or None (frozen: no gradient), a [R, Din], b [Dout, R]
    -> x·Wᵀ + bias + scaling·(x·Aᵀ)·Bᵀ [.., Dout] in x's dtype; gradients for x, a and b."""
    return _LoraLinear.apply(x, weight, bias, a, b, scaling)


def lora_linear_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """PEFT's LoRA Linear forward through lora_linear; PEFT's own forward where `projection` says it does not
    apply (or with extra arguments)."""
    p = None if args or kwargs else projection(self, x)
    if p is None or p[2] is None:
        return type(self).forward(self, x, *args, **kwargs)
    return lora_linear(x, *p)


def projection(module: torch.nn.Module, x: torch.Tensor):
    """A linear module as (weight, bias, a, b, scaling) for x (a = b = None: a plain frozen nn.Linear), or None
    where the LoRA Function does not compute what its forward does: a PEFT LoRA Linear with its adapters disabled
    or merged, several active adapters, a variant (DoRA), dropout, a bias on lora_B, fan_in_fan_out; a base layer
    that is not a plain nn.Linear (or has hooks, a trainable weight or bias, or another dtype than x).
    Called on every forward: submodules and parameters are read from their dicts (nn.Module's attribute lookup
    is a slow path)."""
    if type(module) is torch.nn.Linear:
        return _plain_linear(module, x)
    names = getattr(module, "active_adapters", None)
    if names is None or len(names) != 1 or module.disable_adapters or module.merged or module.fan_in_fan_out:
        return None
    name, subs = names[0], module._modules
    lora_a, lora_b = subs["lora_A"]._modules.get(name), subs["lora_B"]._modules.get(name)
    if (lora_a is None or name in getattr(module, "lora_variant", ())
            or not isinstance(subs["lora_dropout"]._modules[name], torch.nn.Identity)
            or lora_b._parameters.get("bias") is not None):
        return None
    base = _plain_linear(subs["base_layer"], x)
    if base is None:
        return None
    return base[0], base[1], lora_a._parameters["weight"], lora_b._parameters["weight"], module.scaling[name]


def _plain_linear(base, x: torch.Tensor):
    """(weight, bias, None, None, 1.0) where base(x) is F.linear(x, weight, bias) with a frozen weight (and bias) of
    x's dtype; None otherwise."""
    if (type(base) is not torch.nn.Linear or base._forward_hooks or base._forward_pre_hooks
            or "forward" in base.__dict__):
        return None
    weight, bias = base._parameters["weight"], base._parameters["bias"]
    if weight.requires_grad or weight.dtype != x.dtype or (bias is not None and bias.requires_grad):
        return None
    return weight, bias, None, None, 1.0
