"""The training forward: frozen base weights in the model dtype, trainable fp32 LoRA pairs, loss on label tokens.

One decoder layer is one `torch.utils.checkpoint` unit: only each layer's input [B, T, D] is kept between forward and
backward, the rest is recomputed (the same RNG state, so LoRA dropout masks repeat). The base GEMMs use the fused
qkv / gate_up matrices of accel.weights (one GEMM instead of three / two); each LoRA branch adds its own low-rank
term to its slice. The loss never materialises [B·T, V] logits: the trained positions are gathered first and the
lm_head + cross-entropy run in checkpointed chunks, so the fp32 logits of one chunk exist at a time.
Sequences are right-padded: causal attention already hides later pad keys from real queries, so no mask is needed.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from accel.ops import rope_tables
from accel.train.attention import attention_reference, flash_attention
from accel.ops.torch_ops import add_lora
from accel.train.lora import LoraModule, weight_name
from refimpl.formats.lora import LLAMA_LINEARS
from accel.weights import Weights
from refimpl.model.config import LlamaConfig
from refimpl.train.data import IGNORE

LOSS_CHUNK = 512  # rows of [rows, V] fp32 logits alive at once (0.25 GB at V = 128256)


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


def _adapt(out, x, adapter, dropout: float):
    """out [.., Dout] = x @ Wᵀ in the model dtype; add adapter = (A, B, scale)'s LoRA term in fp32 (or nothing)."""
    return out if adapter is None else add_lora(out, x, *adapter, dropout=dropout)


def decoder_layer(x, cos, sin, weights: tuple, adapters: tuple, shape: tuple, eps: float, dropout: float):
    """One decoder layer over plain tensors (so one compiled graph serves every layer).

    x [B, T, D]; weights = (attn_norm, qkv, o, mlp_norm, gate_up, down) of accel.weights.LayerWeights; adapters =
    one (A, B, scale) or None per LLAMA_LINEARS entry (q, k, v, o, gate, up, down); shape = (H, K, E, F)."""
    attn_norm, qkv, o_w, mlp_norm, gate_up, down = weights
    aq, ak, av, ao, ag, au, ad = adapters
    H, K, E, Fi = shape
    B, T, _ = x.shape
    h = rms_norm(x, attn_norm, eps)
    q, k, v = F.linear(h, qkv).split([H * E, K * E, K * E], dim=-1)  # [B, T, D] -> [B, T, (H+2K)·E]
    q = _adapt(q, h, aq, dropout).view(B, T, H, E)
    k = _adapt(k, h, ak, dropout).view(B, T, K, E)
    v = _adapt(v, h, av, dropout).view(B, T, K, E)
    a = attention(rope(q, cos, sin), rope(k, cos, sin), v).reshape(B, T, H * E)  # [B, T, H, E] -> [B, T, H·E]
    x = x + _adapt(F.linear(a, o_w), a, ao, dropout)  # [B, T, H·E] -> [B, T, D]
    h = rms_norm(x, mlp_norm, eps)
    gate, up = F.linear(h, gate_up).split([Fi, Fi], dim=-1)  # [B, T, D] -> 2 × [B, T, F]
    act = F.silu(_adapt(gate, h, ag, dropout)) * _adapt(up, h, au, dropout)
    return x + _adapt(F.linear(act, down), act, ad, dropout)  # [B, T, F] -> [B, T, D]


class TrainModel:
    def __init__(self, weights: Weights, cfg: LlamaConfig, lora: dict[str, LoraModule], dropout: float = 0.0,
                 checkpointing: bool = True, compile: bool = False):
        self.w, self.cfg, self.lora, self.dropout, self.checkpointing = weights, cfg, lora, dropout, checkpointing
        self.training = True
        # compiled, the norms, RoPE, SiLU·up and LoRA scalings fuse into a few kernels; attention stays the Triton
        # kernel (a graph break); dynamic=False: every layer has the same shapes, so one graph serves them all
        self.layer_fn = torch.compile(decoder_layer, dynamic=False) if compile else decoder_layer

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for m in self.lora.values() for p in (m.a, m.b)]

    def _layer(self, x, i: int, cos, sin):
        cfg, lw = self.cfg, self.w.layers[i]
        adapters = []
        for t in LLAMA_LINEARS:
            m = self.lora.get(weight_name(i, t))
            adapters.append(None if m is None else (m.a, m.b, m.scale))
        return self.layer_fn(x, cos, sin, (lw.attn_norm, lw.qkv, lw.o, lw.mlp_norm, lw.gate_up, lw.down),
                             tuple(adapters), (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                                               cfg.intermediate_size), cfg.rms_norm_eps,
                             self.dropout if self.training else 0.0)

    def hidden(self, ids):
        """ids [B, T] -> final-norm hidden states [B, T, D] in the model dtype."""
        T = ids.shape[1]
        cos, sin = rope_tables(torch.arange(T, device=ids.device), self.cfg.head_dim, self.cfg.rope_theta,
                               self.cfg.rope_scaling)  # [T, E/2] fp32 each
        x = F.embedding(ids, self.w.embed)  # [B, T, D]
        for i in range(self.cfg.num_hidden_layers):
            if self.checkpointing and torch.is_grad_enabled():
                x = checkpoint(self._layer, x, i, cos, sin, use_reentrant=False)
            else:
                x = self._layer(x, i, cos, sin)
        return rms_norm(x, self.w.norm, self.cfg.rms_norm_eps)

    def loss_sum(self, ids, labels):
        """Summed cross-entropy (fp32) over the label tokens of ids [B, T], labels [B, T] (IGNORE elsewhere),
        each predicted from the previous position; and the number of such tokens."""
        h = self.hidden(ids)[:, :-1]  # [B, T-1, D]: position t predicts labels[t + 1]
        targets = labels[:, 1:]  # [B, T-1]
        keep = targets != IGNORE
        h, targets = h[keep], targets[keep]  # [N, D], [N]: only trained positions reach the lm_head
        total = h.new_zeros((), dtype=torch.float32)
        for start in range(0, h.shape[0], LOSS_CHUNK):
            rows = slice(start, start + LOSS_CHUNK)
            total = total + checkpoint(_chunk_loss, h[rows], self.w.lm_head, targets[rows], use_reentrant=False)
        return total, int(targets.numel())


def _chunk_loss(h, lm_head, targets):
    logits = F.linear(h, lm_head).float()  # [N, D] -> [N, V], upcast as HF's loss does
    return F.cross_entropy(logits, targets, reduction="sum")
