"""HF's self-attention projections (q, k, v: PEFT LoRA or plain frozen linears) and RoPE as one autograd Function,
for accel.hf.apply(rope=True, lora=True) with attn_implementation="llama32": one node for what costs four Functions
and ~10 views op by op (an HF + PEFT step at batch 1 is mostly host time). Saves x and the [N, R] adapter products;
the RoPE tables are the model's (shared by every layer).

    x [B, T, D] -> q [B, H, T, E], k [B, K, T, E] (rotated), v [B, K, T, E]   (HF's layout: transposed views of
                                                                            [B·T, heads, E] rows, made inside)
"""
from __future__ import annotations

import torch

from accel.hf.lora import casts, project, project_backward
from accel.kernels.rope import rope_fwd


class _LoraQKVRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, heads, *flat):
        # flat: per projection (q, k, v) weight, bias, a, b (a = b = None without an adapter); 3 scalings
        projs, scalings = [flat[4 * i:4 * i + 4] for i in range(3)], flat[12:15]
        x2 = x.reshape(-1, x.shape[-1])  # [N, D]
        (q, xa_q), (k, xa_k), (v, xa_v) = (project(x2, w, bias, *casts(a, b, x.dtype), s)
                                           for (w, bias, a, b), s in zip(projs, scalings))  # [N, heads·E] each
        N, E = x2.shape[0], q.shape[1] // heads[0]
        q, k, v = q.view(N, heads[0], E), k.view(N, heads[1], E), v.view(N, heads[1], E)
        rope_fwd(q, k, cos, sin, q_out=q, k_out=k)  # in place: the GEMMs' fresh outputs
        ctx.save_for_backward(x2, xa_q, xa_k, xa_v)
        # parameters and the model's RoPE tables kept as they are, outside the saved tensors that gradient
        # checkpointing drops and recomputes
        ctx.params, ctx.scalings, ctx.tables = [(w, a, b) for w, _, a, b in projs], scalings, (cos, sin)
        ctx.x_shape = x.shape
        B, T = x.shape[:2]  # HF's layout, as views made here: no autograd view nodes outside
        return tuple(t.view(B, T, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))  # [B, heads, T, E]

    @staticmethod
    def backward(ctx, dq, dk, dv):
        x2, xa_q, xa_k, xa_v = ctx.saved_tensors
        need = ctx.needs_input_grad
        cos, sin = ctx.tables
        # [B, heads, T, E] -> [B·T, heads, E] rows (a view where the gradient is laid out as the output is)
        dq, dk, dv = (d.transpose(1, 2).reshape(-1, *d.shape[1:2], d.shape[-1]) for d in (dq, dk, dv))
        dq, dk = (d if d.stride(-1) == 1 else d.contiguous() for d in (dq, dk))
        dq, dk = rope_fwd(dq, dk, cos, -sin)  # the inverse rotation, [N, heads, E]
        dx = None
        out = []
        for d, xa, (w, a, b), s, i in zip((dq, dk, dv), (xa_q, xa_k, xa_v), ctx.params, ctx.scalings, range(3)):
            grads_ab = need[6 + 4 * i] or need[7 + 4 * i]
            d2 = d.reshape(d.shape[0], -1)  # [N, heads·E]
            dx, (da, db) = project_backward(d2, x2, xa, w, *casts(a, b, d.dtype, last=True), s, grads_ab,
                                                dx=dx)
            out += [None, None, None if da is None else da.to(a.dtype), None if db is None else db.to(b.dtype)]
        dx = dx.view(ctx.x_shape) if need[0] else None
        return (dx, None, None, None, *out, None, None, None)


@torch.compiler.disable  # opaque to torch.compile, as accel/train/fused.py's ops
def lora_qkv_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: tuple[int, int], q: tuple,
                  k: tuple, v: tuple):
    """x [B, T, D]; cos/sin [B·T, E/2] fp32 (the rows' tables); heads (H, K); q, k, v: (weight, bias or None (both
    frozen), a [R, D] or None, b [Dout, R] or None, scaling) -> (q [B, H, T, E] rotated, k [B, K, T, E] rotated,
    v [B, K, T, E]) in x's dtype, HF's layout (views); gradients for x and the adapters."""
    flat = [t for p in (q, k, v) for t in p[:4]]
    return _LoraQKVRope.apply(x, cos, sin, heads, *flat, q[4], k[4], v[4])
