"""One decoder layer as a single autograd.Function with a hand-written backward: its own activation checkpoint.

The eager autograd layer (accel.train.model.grouped_layer under torch.utils.checkpoint) records every op with autograd
in the forward and again in the recompute, then walks that graph; on the GPU the host then takes longer than the
kernels.
Here the forward runs without autograd and keeps only the layer input x; the backward recomputes the forward keeping
its intermediates, then runs the backward by hand: the frozen GEMMs' dX, each LoRA group's dA / dB, and the Triton
backward kernels (RMSNorm, RoPE as the inverse rotation, SwiGLU, FlashAttention). The LoRA group tensors
(accel.train.lora.LoraGroup's a, b, in the model dtype) are the Function's differentiable inputs; autograd carries
their gradients back to the fp32 masters through the casts that built them.
LoRA dropout: each adapted module's input to its A is dropped with its own mask (accel.train.lora.dropout_masks,
as PEFT does); the forward keeps the RNG state it drew the masks from and the backward's recompute restores it, so
the masks repeat without being stored.
Limit: the LoRA branch in the model dtype (else the model uses the autograd layer).
"""
from __future__ import annotations

import torch

from accel.kernels.flash_attn_train import flash_attn_bwd, flash_attn_train_fwd
from accel.kernels.rms_norm import rms_norm_bwd, rms_norm_fwd
from accel.kernels.rope import rope_fwd
from accel.kernels.swiglu import swiglu_gate_up_bwd, swiglu_gate_up_fwd
from accel.train.fused import rope_rows
from accel.train.lora import dropout_masks, lora_linear


def _linear_bwd(x, w, a, b, xa, dy, need_dx: bool = True, ranks=(), masks=()):
    """Backward of lora_linear with w frozen: -> (dx [N, Din] or None, da [ΣR, Din], db [Dout, ΣR]) (None, None
    without a LoRA group). masks: lora_linear's dropout masks, one per module of `ranks` (module i's A saw
    x · masks[i])."""
    if a is None:
        return (dy @ w if need_dx else None), None, None  # [N, Dout] @ [Dout, Din]
    d_xa = dy @ b  # [N, Dout] @ [Dout, ΣR] -> [N, ΣR]
    db = dy.t() @ xa  # [Dout, N] @ [N, ΣR] -> [Dout, ΣR]
    if not masks:
        da = d_xa.t() @ x  # [ΣR, N] @ [N, Din] -> [ΣR, Din]
        dx = torch.addmm(dy @ w, d_xa, a) if need_dx else None  # [N, Din] + [N, ΣR] @ [ΣR, Din]
        return dx, da, db
    d_xas, a_s = d_xa.split(ranks, dim=-1), a.split(ranks)  # module i: [N, R_i], [R_i, Din]
    da = torch.cat([d.t() @ (x * m) for d, m in zip(d_xas, masks)])  # [R_i, N] @ [N, Din] each -> [ΣR, Din]
    dx = None
    if need_dx:
        dx = dy @ w  # [N, Dout] @ [Dout, Din]
        for d, a_i, m in zip(d_xas, a_s, masks):
            dx += (d @ a_i) * m  # the dropout's backward: the same mask on the gradient
    return dx, da, db


def _masks(x, a, ranks, dropout: float) -> list:
    return dropout_masks(x, dropout, len(ranks)) if dropout and a is not None else []


def _forward(x, cos, sin, eps, shape, weights, lora, ranks, dropout: float = 0.0):
    """The layer's forward over rows; returns y [B, T, D] and the intermediates the backward needs (with dropout,
    each group's masks, drawn in the order qkv, o, gate_up, down)."""
    attn_norm, w_qkv, w_o, mlp_norm, w_gu, w_d = weights
    (a_qkv, b_qkv), (a_o, b_o), (a_gu, b_gu), (a_d, b_d) = lora
    r_qkv, r_o, r_gu, r_d = ranks
    H, K, E, Fi = shape
    B, T, D = x.shape
    x0 = x.reshape(B * T, D)
    h1 = rms_norm_fwd(x0, attn_norm, eps)  # [N, D]
    m_qkv = _masks(h1, a_qkv, r_qkv, dropout)
    qkv, xa_qkv = lora_linear(h1, w_qkv, a_qkv, b_qkv, r_qkv, m_qkv)  # [N, (H+2K)·E]
    q, k, v = qkv.split([H * E, K * E, K * E], dim=-1)
    c, s = rope_rows(cos, sin, B)
    qr, kr = rope_fwd(q.view(B * T, H, E), k.view(B * T, K, E), c, s)  # [N, H, E], [N, K, E]
    q4, k4, v4 = qr.view(B, T, H, E), kr.view(B, T, K, E), v.view(B, T, K, E)
    o, lse = flash_attn_train_fwd(q4, k4, v4, True, None)  # [B, T, H, E]
    att = o.view(B * T, H * E)
    m_o = _masks(att, a_o, r_o, dropout)
    att_o, xa_o = lora_linear(att, w_o, a_o, b_o, r_o, m_o)
    x1 = x0 + att_o  # [N, D]
    h2 = rms_norm_fwd(x1, mlp_norm, eps)
    m_gu = _masks(h2, a_gu, r_gu, dropout)
    gu, xa_gu = lora_linear(h2, w_gu, a_gu, b_gu, r_gu, m_gu)  # [N, 2F]
    act = swiglu_gate_up_fwd(gu)  # [N, F]
    m_d = _masks(act, a_d, r_d, dropout)
    down, xa_d = lora_linear(act, w_d, a_d, b_d, r_d, m_d)
    y = x1 + down
    saved = dict(x0=x0, h1=h1, xa_qkv=xa_qkv, q4=q4, k4=k4, v4=v4, o=o, lse=lse, att=att, xa_o=xa_o, x1=x1, h2=h2,
                 gu=gu, xa_gu=xa_gu, act=act, xa_d=xa_d, m_qkv=m_qkv, m_o=m_o, m_gu=m_gu, m_d=m_d)
    return y.view(B, T, D), saved


def _rng_state(device):
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_rng_state(device, state) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class _DecoderLayer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, eps, shape, ranks, dropout, weights, *lora_flat):
        lora = tuple(zip(lora_flat[0::2], lora_flat[1::2]))
        ctx.rng = _rng_state(x.device) if dropout else None  # where the masks come from, for the recompute
        with torch.no_grad():
            y, _ = _forward(x, cos, sin, eps, shape, weights, lora, ranks, dropout)
        ctx.save_for_backward(x, cos, sin, *(t for t in lora_flat if t is not None))
        ctx.present = tuple(t is not None for t in lora_flat)
        ctx.eps, ctx.shape, ctx.weights, ctx.ranks, ctx.dropout = eps, shape, weights, ranks, dropout
        return y

    @staticmethod
    def backward(ctx, dy):
        x, cos, sin, *present = ctx.saved_tensors
        it = iter(present)
        lora_flat = [next(it) if p else None for p in ctx.present]
        lora = tuple(zip(lora_flat[0::2], lora_flat[1::2]))
        (a_qkv, b_qkv), (a_o, b_o), (a_gu, b_gu), (a_d, b_d) = lora
        attn_norm, w_qkv, w_o, mlp_norm, w_gu, w_d = ctx.weights
        H, K, E, Fi = ctx.shape
        B, T, D = x.shape
        r_qkv, r_o, r_gu, r_d = ctx.ranks
        with torch.no_grad(), torch.random.fork_rng(devices=[x.device] if x.is_cuda else [],
                                                    enabled=ctx.rng is not None):
            if ctx.rng is not None:
                _set_rng_state(x.device, ctx.rng)  # the forward's masks again
            _, s = _forward(x, cos, sin, ctx.eps, ctx.shape, ctx.weights, lora, ctx.ranks, ctx.dropout)
            dy = dy.reshape(B * T, D)
            dy = dy if dy.stride(-1) == 1 else dy.contiguous()
            d_act, da_d, db_d = _linear_bwd(s["act"], w_d, a_d, b_d, s["xa_d"], dy, True, r_d, s["m_d"])
            d_gu = swiglu_gate_up_bwd(s["gu"], d_act)  # [N, 2F]
            dh2, da_gu, db_gu = _linear_bwd(s["h2"], w_gu, a_gu, b_gu, s["xa_gu"], d_gu, True, r_gu, s["m_gu"])
            dx1 = dy + rms_norm_bwd(s["x1"], mlp_norm, ctx.eps, dh2)  # the residual's gradient joins the norm's
            d_att, da_o, db_o = _linear_bwd(s["att"], w_o, a_o, b_o, s["xa_o"], dx1, True, r_o, s["m_o"])
            dq, dk, dv = flash_attn_bwd(s["q4"], s["k4"], s["v4"], s["o"], s["lse"], d_att.view(B, T, H, E), True,
                                        None)
            c, sn = rope_rows(cos, sin, B)
            dq, dk = rope_fwd(dq.view(B * T, H, E), dk.view(B * T, K, E), c, -sn)  # the inverse rotation
            d_qkv = torch.cat([dq.view(B * T, H * E), dk.view(B * T, K * E), dv.reshape(B * T, K * E)], dim=-1)
            need_dx = ctx.needs_input_grad[0]
            dh1, da_qkv, db_qkv = _linear_bwd(s["h1"], w_qkv, a_qkv, b_qkv, s["xa_qkv"], d_qkv, need_dx, r_qkv,
                                              s["m_qkv"])
            dx = (dx1 + rms_norm_bwd(s["x0"], attn_norm, ctx.eps, dh1)).view(B, T, D) if need_dx else None
        return (dx, None, None, None, None, None, None, None, da_qkv, db_qkv, da_o, db_o, da_gu, db_gu, da_d, db_d)


def manual_layer(x, cos, sin, weights: tuple, groups: tuple, shape: tuple, eps: float, dropout: float = 0.0):
    """x [B, T, D] -> the decoder layer's output [B, T, D]; weights as accel.train.model.grouped_layer's, groups =
    accel.train.model.layer_groups(...) (LoRA in x's dtype); cos/sin [T, E/2] fp32; dropout: LoRA dropout, each
    module's masks drawn as grouped_layer draws them (the same RNG state gives the same masks)."""
    lora_flat, ranks = [], []
    for g in groups:
        assert g is None or g.a.dtype == x.dtype, "the manual layer computes LoRA in the model dtype"
        lora_flat += [None, None] if g is None else [g.a, g.b]
        ranks.append(() if g is None else tuple(g.ranks))
    return _DecoderLayer.apply(x, cos, sin, eps, shape, tuple(ranks), float(dropout), weights, *lora_flat)
