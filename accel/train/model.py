"""The training forward: frozen base weights in the model dtype, trainable fp32 LoRA pairs, loss on label tokens.

One decoder layer is one `torch.utils.checkpoint` unit: only each layer's input [B, T, D] is kept between forward and
backward, the rest is recomputed (the same RNG state, so LoRA dropout masks repeat). The base GEMMs use the fused
qkv / gate_up matrices of accel.weights (one GEMM instead of three / two); their LoRA pairs are grouped the same way
(accel.train.lora.lora_group: one stacked A, one block-diagonal B accumulated into the fused output), built once a
step outside the checkpoints. On CUDA the norms, RoPE and SwiGLU are the Triton autograd Functions of
accel.train.fused (`kernels=True`), or plain torch for torch.compile to fuse (`kernels=False`); with the kernels, each
layer is instead accel.train.layer's single Function (its own checkpoint, backward by hand, LoRA dropout included).
The loss never materialises [B·T, V] logits: the trained positions are gathered first, then the lm_head and the
cross-entropy run fused over row chunks, dX computed in the same pass (accel.train.loss).
Sequences are right-padded: causal attention already hides later pad keys from real queries, so no mask is needed.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from accel.ops import rope_tables
from accel.train import fused
from accel.train.attention import attention_reference, flash_attention
from accel.train.layer import manual_layer
from accel.train.loop import collate
from accel.train.lora import LoraModule, adapted_linear, lora_group, weight_name
from accel.train.loss import linear_cross_entropy
from refimpl.formats.lora_targets import LLAMA_LINEARS
from accel.weights import Weights
from refimpl.model.config import LlamaConfig
from refimpl.train.data import IGNORE


@torch.compiler.disable
def attention(q, k, v):
    """Causal GQA attention, q [B, T, H, E], k/v [B, T, K, E] -> [B, T, H, E]: the Triton FlashAttention on CUDA;
    on the CPU its plain-torch twin (the interpreter would run the kernel, slowly, at every CPU training step)."""
    return flash_attention(q, k, v, causal=True) if q.is_cuda else attention_reference(q, k, v, causal=True)


def rms_norm(x, weight, eps):
    """HF's order: normalise in fp32, cast to x's dtype, then multiply by the weight."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def rope(x, cos, sin):
    """x [B, T, H, E], cos/sin [T, E/2] fp32 -> rotated (rotate_half layout), computed in fp32."""
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]  # [B, T, H, E/2] each
    c, s = cos[:, None, :], sin[:, None, :]  # [T, E/2] -> [T, 1, E/2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


def swiglu(gate_up):
    """gate_up [.., 2F] -> silu(gate) · up [.., F], two rounded torch ops as HF's MLP."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def layer_groups(adapters: tuple, shape: tuple, dtype) -> tuple:
    """One (A, B, scale) or None per LLAMA_LINEARS entry -> the LoraGroup (or None) of each fused linear:
    (qkv, o, gate_up, down), computing in `dtype`."""
    aq, ak, av, ao, ag, au, ad = adapters
    H, K, E, Fi = shape
    return (lora_group((aq, ak, av), (H * E, K * E, K * E), dtype), lora_group((ao,), (None,), dtype),
            lora_group((ag, au), (Fi, Fi), dtype), lora_group((ad,), (None,), dtype))


def grouped_layer(x, cos, sin, weights: tuple, groups: tuple, shape: tuple, eps: float, dropout: float,
                  kernels: bool = False):
    """One decoder layer over plain tensors (so one compiled graph serves every layer).

    x [B, T, D]; weights = (attn_norm, qkv, o, mlp_norm, gate_up, down) of accel.weights.LayerWeights; groups =
    layer_groups(...); shape = (H, K, E, F); kernels: the Triton autograd Functions for norm, RoPE and SwiGLU."""
    attn_norm, qkv, o_w, mlp_norm, gate_up, down = weights
    g_qkv, g_o, g_gate_up, g_down = groups
    norm, act = (fused.rms_norm, fused.swiglu) if kernels else (rms_norm, swiglu)
    H, K, E, Fi = shape
    B, T, _ = x.shape
    h = norm(x, attn_norm, eps)
    q, k, v = adapted_linear(h, qkv, g_qkv, dropout).split([H * E, K * E, K * E], dim=-1)  # -> [B, T, (H+2K)·E]
    q, k, v = q.view(B, T, H, E), k.view(B, T, K, E), v.view(B, T, K, E)
    q, k = fused.rope_qk(q, k, cos, sin) if kernels else (rope(q, cos, sin), rope(k, cos, sin))
    a = attention(q, k, v).reshape(B, T, H * E)  # [B, T, H, E] -> [B, T, H·E]
    x = x + adapted_linear(a, o_w, g_o, dropout)  # [B, T, H·E] -> [B, T, D]
    h = norm(x, mlp_norm, eps)
    act_out = act(adapted_linear(h, gate_up, g_gate_up, dropout))  # [B, T, D] -> [B, T, 2F] -> [B, T, F]
    return x + adapted_linear(act_out, down, g_down, dropout)  # [B, T, F] -> [B, T, D]


class TrainModel:
    def __init__(self, weights: Weights, cfg: LlamaConfig, lora: dict[str, LoraModule], dropout: float = 0.0,
                 checkpointing: bool = True, compile: bool = False, kernels: bool | None = None, lora_dtype=None,
                 manual_backward: bool = True):
        """kernels: the Triton norm / RoPE / SwiGLU Functions (default: on CUDA unless compiled; inside a compiled
        layer each Function is a graph break, which costs more than the fusion gains); lora_dtype: the LoRA
        branch's compute dtype (default: the model dtype; the parameters stay fp32 either way); manual_backward:
        with the kernels and LoRA in the model dtype, each layer is accel.train.layer's single Function (its own
        checkpoint, backward by hand: far fewer host-side ops a step), LoRA dropout included."""
        self.w, self.cfg, self.lora, self.dropout, self.checkpointing = weights, cfg, lora, dropout, checkpointing
        self.kernels, self.lora_dtype = (not compile if kernels is None else kernels), lora_dtype
        self.manual_backward = manual_backward
        self.training = True
        # compiled, what is left unfused (residual adds, the torch ops when kernels=False) fuses; attention and the
        # Triton Functions are graph breaks; dynamic=False: every layer has the same shapes, one graph serves all
        self.layer_fn = torch.compile(grouped_layer, dynamic=False) if compile else grouped_layer

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for m in self.lora.values() for p in (m.a, m.b)]

    def _shape(self) -> tuple:
        cfg = self.cfg
        return cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size

    def _groups(self, i: int) -> tuple:
        """Layer i's LoRA groups, cast from the fp32 masters (once a step, outside the layer's checkpoint)."""
        adapters = []
        for t in LLAMA_LINEARS:
            m = self.lora.get(weight_name(i, t))
            adapters.append(None if m is None else (m.a, m.b, m.scale))
        return layer_groups(tuple(adapters), self._shape(), self.lora_dtype or self.w.embed.dtype)

    def layer(self, x, i: int, cos, sin):
        """Decoder layer i over x [B, T, D] (its own checkpoint when checkpointing)."""
        kernels = x.is_cuda and self.kernels
        lw = self.w.layers[i]
        weights = (lw.attn_norm, lw.qkv, lw.o, lw.mlp_norm, lw.gate_up, lw.down)
        dropout = self.dropout if self.training else 0.0
        if kernels and self.manual_backward and self.checkpointing and self.lora_dtype in (None, x.dtype):
            return manual_layer(x, cos, sin, weights, self._groups(i), self._shape(), self.cfg.rms_norm_eps, dropout)
        args = (cos, sin, weights, self._groups(i), self._shape(), self.cfg.rms_norm_eps, dropout, kernels)
        if self.checkpointing and torch.is_grad_enabled():
            return checkpoint(self.layer_fn, x, *args, use_reentrant=False)
        return self.layer_fn(x, *args)

    def hidden(self, ids):
        """ids [B, T] -> final-norm hidden states [B, T, D] in the model dtype."""
        T = ids.shape[1]
        cos, sin = rope_tables(torch.arange(T, device=ids.device), self.cfg.head_dim, self.cfg.rope_theta,
                               self.cfg.rope_scaling)  # [T, E/2] fp32 each
        x = F.embedding(ids, self.w.embed)  # [B, T, D]
        for i in range(self.cfg.num_hidden_layers):
            x = self.layer(x, i, cos, sin)
        return (fused.rms_norm if ids.is_cuda and self.kernels else rms_norm)(x, self.w.norm, self.cfg.rms_norm_eps)

    def collate(self, batch, device) -> tuple:
        """A micro-batch of samples -> loss_sum's arguments: (ids [B, T], labels [B, T]), right-padded."""
        return collate(batch, device)

    def loss_sum(self, ids, labels, *inputs):
        """Summed cross-entropy (fp32) over the label tokens of ids [B, T], labels [B, T] (IGNORE elsewhere),
        each predicted from the previous position; and the number of such tokens. `inputs` go to hidden."""
        h = self.hidden(ids, *inputs)[:, :-1]  # [B, T-1, D]: position t predicts labels[t + 1]
        targets = labels[:, 1:]  # [B, T-1]
        keep = targets != IGNORE
        h, targets = h[keep], targets[keep]  # [N, D], [N]: only trained positions reach the lm_head
        return linear_cross_entropy(h, self.w.lm_head, targets), int(targets.numel())
