"""HF's SwiGLU MLP with PEFT LoRA on its projections as one autograd Function, for accel.hf.apply(swiglu=True,
lora=True): down(silu(gate(x)) · up(x)), each projection x·Wᵀ (+ bias) (+ s·(x·Aᵀ)·Bᵀ where it has an adapter),
the SwiGLU in the Triton kernels of accel/kernels/swiglu.py, the adapters' branch in the activations' dtype as
accel/hf/lora.py computes it. One autograd node for what costs four (three LoRA linears and the SwiGLU) otherwise:
an HF + PEFT step at batch 1 is mostly host time. Saves x, gate, up and the [N, R] adapter products; the SwiGLU
output is recomputed in the backward (one kernel) instead of kept, and the backward's [N, F] temporaries share
buffers: the SwiGLU output, its gradient and the gate's gradient are one (the up's gradient a second).
"""
from __future__ import annotations

import torch

from accel.hf.lora import casts, project, project_backward
from accel.kernels.swiglu import swiglu_bwd, swiglu_fwd


class _LoraSwiGLUMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, *flat):
        # flat: per projection (gate, up, down) weight, bias, a, b (a = b = None without an adapter); 3 scalings
        projs, scalings = [flat[4 * i:4 * i + 4] for i in range(3)], flat[12:15]
        x2 = x.reshape(-1, x.shape[-1])  # [N, D]
        (g, xa_g), (u, xa_u) = (project(x2, w, bias, *casts(a, b, x.dtype), s)
                                for (w, bias, a, b), s in zip(projs[:2], scalings[:2]))  # [N, F] each
        h = swiglu_fwd(g, u)  # [N, F]
        w, bias, a, b = projs[2]
        y, xa_d = project(h, w, bias, *casts(a, b, x.dtype), scalings[2])  # [N, D]
        ctx.save_for_backward(x2, g, u, xa_g, xa_u, xa_d)
        # parameters kept as they are, outside the saved tensors that gradient checkpointing drops and recomputes
        ctx.params, ctx.scalings = [(w, a, b) for w, _, a, b in projs], scalings
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        x2, g, u, xa_g, xa_u, xa_d = ctx.saved_tensors
        need = ctx.needs_input_grad
        grads_ab = [need[3 + 4 * i] or need[4 + 4 * i] for i in range(3)]
        dy2 = dy.reshape(-1, dy.shape[-1])  # [N, D]
        (pg, pu, pd), (sg, su, sd) = ctx.params, ctx.scalings
        h = swiglu_fwd(g, u) if grads_ab[2] else None  # recomputed: only the down adapter's dA reads it
        # dh into h's buffer (once dA has read h), then d gate into dh's: one [N, F] buffer for the three
        dh, ab_d = project_backward(dy2, h, xa_d, pd[0], *casts(*pd[1:], dy.dtype, last=True), sd,
                                    grads_ab[2], into_x=h is not None)
        dg, du = swiglu_bwd(g, u, dh, dgate=dh)  # [N, F] each
        del h, dh
        dx, ab_g = project_backward(dg, x2, xa_g, pg[0], *casts(*pg[1:], dy.dtype, last=True), sg, grads_ab[0])
        dx, ab_u = project_backward(du, x2, xa_u, pu[0], *casts(*pu[1:], dy.dtype, last=True), su, grads_ab[1],
                                    dx=dx)
        out = [dx.view(*dy.shape[:-1], x2.shape[-1]) if need[0] else None]
        for (da, db), (_, a, b) in zip((ab_g, ab_u, ab_d), ctx.params):
            out += [None, None, None if da is None else da.to(a.dtype), None if db is None else db.to(b.dtype)]
        return (*out, None, None, None)


@torch.compiler.disable  # opaque to torch.compile, as accel/train/fused.py's ops
def lora_swiglu_mlp(x: torch.Tensor, gate: tuple, up: tuple, down: tuple) -> torch.Tensor:
    """x [.., D]; gate, up, down: (weight [Dout, Din], bias or None (both frozen), a [R, Din] or None,
    b [Dout, R] or None, scaling) -> down(silu(gate(x)) · up(x)) [.., D] in x's dtype, gradients for x and the
    adapters."""
    flat = [t for p in (gate, up, down) for t in p[:4]]
    return _LoraSwiGLUMLP.apply(x, *flat, gate[4], up[4], down[4])
