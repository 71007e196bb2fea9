"""The fast forward: prefill (whole prompt) and the one-token decode step, over fused weights and a static cache.

Same computation as `refimpl.model.llama.forward` (the trace mode runs that one over `accel.ops`), rearranged for speed:
    * fused QKV and gate_up GEMMs (accel.weights), the residual add fused into the next RMSNorm;
    * RoPE fused into the KV-cache write (k is rotated straight into the cache slot, v copied beside it);
    * prefill attends with the flash-attention kernel over the fresh k/v; decode with the split-sequence decode
      kernel over the cache, its context length a device tensor so that one CUDA graph serves every position;
    * decode reads cos/sin rows from tables precomputed for the whole cache and indexes them on the device;
    * decode's projections are Triton GEMVs (accel/kernels/gemv.py) with the RMSNorm, SwiGLU and residual add
      folded in, and the qkv GEMV carrying RoPE and the cache write (accel/kernels/qkv_rope.py): 5 launches a
      layer instead of 11 (cuBLAS's M=1 kernel left 2/3 of the SMs idle on qkv/o).
Nothing here yields, syncs with the host, or allocates a size that depends on the position: `decode_step` is
what the engine captures in a CUDA graph.

`Kernels` calls the Triton launchers of accel/kernels directly (the hot loop skips accel.ops' per-call dispatch);
without Triton (a CPU without the interpreter) it uses the plain torch versions below.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from refimpl.model.config import LlamaConfig

from . import ops
from .ops import torch_add_rms_norm, torch_grouped_attention, torch_rms_norm, torch_rotate, torch_swiglu_gate_up
from .kernels.argmax import argmax_fwd
from .kernels.decode_attn import decode_attention_fwd
from .kernels.embedding import embedding_fwd
from .kernels.flash_attn import flash_attention_fwd
from .kernels.gemv import PDL_OFF, gemv_fwd
from .kernels.rms_norm import add_rms_norm_fwd, rms_norm_fwd
from .kernels.qkv_rope import qkv_rope_fwd
from .kernels.rope import rope_kv_write_fwd
from .kernels.swiglu import swiglu_gate_up_fwd
from .weights import Weights


# ---- plain torch versions of the fused ops (the rest are accel.ops' torch_*): the path without Triton (a CPU
# without the interpreter), and a graph-capturable baseline on CUDA. Same dtype order as the kernels. ----

def torch_norm_linear(x, norm_weight, weight, eps):
    return F.linear(torch_rms_norm(x, norm_weight, eps), weight)  # [1, D] -> [1, N]


def torch_linear_add(a, weight, residual):
    """residual += a @ weightᵀ, in place; the product is rounded to the dtype before the add, as x + o is."""
    return residual.add_(F.linear(a, weight))


def torch_swiglu_linear_add(gate_up, weight, residual):
    return residual.add_(F.linear(torch_swiglu_gate_up(gate_up), weight))


# (N, K) weight shapes where cuBLAS beats the Triton GEMV in the decode step: these run the unfused path (norm
# kernel + F.linear, F.linear + add). None since v6a: the 3B gate_up, the last one, moved to a split GEMV with one
# masked 4096-wide slice (28.65 µs vs rms_norm + cuBLAS 29.22; nvidia-h200, 2026-11-21, tools/bench/NOTES.md v6).
CUBLAS_SHAPES: set[tuple[int, int]] = set()


# The programmatic-dependent-launch mode of the decode step's Triton kernels (accel/kernels/gemv.py: PDL_OFF,
# PDL_EARLY, PDL_LATE). Off: every PDL mode made the engine's decode slower (nvidia-h200, 2026-11-21, 1B 1131.0
# tok/s off, 1100.3 late, 1001.6 early; NOTES.md v6).
DECODE_PDL = PDL_OFF


def triton_norm_linear(x, norm_weight, weight, eps, pdl=PDL_OFF):
    if tuple(weight.shape) in CUBLAS_SHAPES:
        return F.linear(rms_norm_fwd(x, norm_weight, eps), weight)
    return gemv_fwd(weight, x, norm_weight=norm_weight, eps=eps, pdl=pdl)


def triton_linear_add(a, weight, residual, pdl=PDL_OFF):
    if tuple(weight.shape) in CUBLAS_SHAPES:
        return residual.add_(F.linear(a, weight))
    return gemv_fwd(weight, a, residual=residual, out=residual, pdl=pdl)


def triton_swiglu_linear_add(gate_up, weight, residual, pdl=PDL_OFF):
    if tuple(weight.shape) in CUBLAS_SHAPES:
        return residual.add_(F.linear(swiglu_gate_up_fwd(gate_up), weight))
    return gemv_fwd(weight, gate_up, swiglu=True, residual=residual, out=residual, pdl=pdl)


def torch_rope_kv_write(q, k, v, cos, sin, cache_k, cache_v, positions):
    cache_k.index_copy_(1, positions, torch_rotate(k, cos, sin).transpose(0, 1))  # [T, K, E] -> [K, T, E] at positions
    cache_v.index_copy_(1, positions, v.transpose(0, 1))
    return torch_rotate(q, cos, sin)


def unfused_qkv_rope(norm_linear, rope_kv_write):
    """The decode step's norm -> qkv -> rope -> cache write as two ops (the torch path, and the Triton path with
    fuse_qkv off); cos/sin are the position's rows [1, E/2], as decode_step passes them to an unfused Kernels."""
    def qkv_rope(x, norm_weight, weight, eps, cos, sin, position, cache_k, cache_v):
        K, _, E = cache_k.shape
        H = weight.shape[0] // E - 2 * K
        qkv = norm_linear(x, norm_weight, weight, eps)  # [1, D] -> [1, (H+2K)·E]
        q = qkv[:, : H * E].view(1, H, E)
        k = qkv[:, H * E: (H + K) * E].view(1, K, E)
        v = qkv[:, (H + K) * E:].view(1, K, E)
        return rope_kv_write(q, k, v, cos, sin, cache_k, cache_v, position)  # k_rot, v -> cache; q_rot
    return qkv_rope


def torch_greedy_next(logits, token, position, history, step):
    """token = argmax(logits); history[step] = token; step += 1; position += 1 — all on the device."""
    token.copy_(argmax_row(logits))
    history.index_copy_(0, step, token)
    step.add_(1)
    position.add_(1)
    return token


def torch_flash_attn(q, cache_k, cache_v, positions):
    """Causal attention of q [T, H, E] at `positions` over cache slots 0..max(positions) (eager: the key count
    comes to the host)."""
    n = int(positions.max()) + 1
    visible = torch.arange(n, device=q.device)[None, :] <= positions[:, None]  # [T, n]
    return torch_grouped_attention(q, cache_k[:, :n], cache_v[:, :n], visible).to(q.dtype)


def torch_decode_attn(q, cache_k, cache_v, position):
    """q [1, H, E] over slots 0..position of the cache. Masks the whole capacity S rather than slicing to the
    length: a slice needs the length on the host (a sync) and a new shape each step (no CUDA graph)."""
    visible = torch.arange(cache_k.shape[1], device=q.device)[None, :] <= position[:, None]  # [1, S]
    return torch_grouped_attention(q, cache_k, cache_v, visible).to(q.dtype)


class Kernels:
    """The fused ops of the fast path: the Triton launchers of accel/kernels (use_triton; CUDA, or CPU under
    TRITON_INTERPRET=1), or the torch versions above.

    fuse_qkv: the decode step's norm + qkv GEMV + RoPE + cache write as one kernel (accel/kernels/qkv_rope.py);
    pdl: the PDL mode of the decode step's Triton kernels (default DECODE_PDL). Both are off on the torch path.
    """

    def __init__(self, use_triton: bool, fuse_qkv: bool = True, pdl: int | None = None):
        self.triton = use_triton
        self.fused_qkv = use_triton and fuse_qkv
        self.pdl = (DECODE_PDL if pdl is None else pdl) if use_triton else PDL_OFF
        if use_triton:
            p = self.pdl
            self.embedding, self.rms_norm, self.add_rms_norm = embedding_fwd, rms_norm_fwd, add_rms_norm_fwd
            self.rope_kv_write, self.swiglu_gate_up = rope_kv_write_fwd, swiglu_gate_up_fwd
            self.flash_attn = flash_attention_fwd
            self.decode_attn = lambda q, ck, cv, pos: decode_attention_fwd(q, ck, cv, pos, pdl=p)
            self.norm_linear = lambda x, nw, w, eps: triton_norm_linear(x, nw, w, eps, p)
            self.linear_add = lambda a, w, r: triton_linear_add(a, w, r, p)
            self.swiglu_linear_add = lambda g, w, r: triton_swiglu_linear_add(g, w, r, p)
            self.greedy_next = argmax_fwd
            if self.fused_qkv:
                self.qkv_rope = lambda x, nw, w, eps, cos, sin, pos, ck, cv: qkv_rope_fwd(
                    w, x, nw, eps, cos, sin, pos, ck, cv, pdl=p)
            else:
                self.qkv_rope = unfused_qkv_rope(self.norm_linear, rope_kv_write_fwd)
        else:
            self.embedding, self.rms_norm, self.add_rms_norm = F.embedding, torch_rms_norm, torch_add_rms_norm
            self.rope_kv_write, self.swiglu_gate_up = torch_rope_kv_write, torch_swiglu_gate_up
            self.flash_attn, self.decode_attn = torch_flash_attn, torch_decode_attn
            self.norm_linear, self.linear_add = torch_norm_linear, torch_linear_add
            self.swiglu_linear_add = torch_swiglu_linear_add
            self.qkv_rope = unfused_qkv_rope(torch_norm_linear, torch_rope_kv_write)
            self.greedy_next = torch_greedy_next

    def describe(self) -> str:
        return "triton kernels" if self.triton else "torch ops (no triton)"


@functools.lru_cache(maxsize=16)
def _row_width(n: int) -> int:
    """A row width near 512 that divides n when one exists (128256 = 256 × 501): no tail to handle."""
    return next((c for c in range(512, 255, -1) if n % c == 0), 512)


def argmax_row(logits):
    """logits [1, V] (or [V]) -> [1] int64 index of the first maximum, on the device with no host sync.

    On CUDA one launch of accel/kernels/argmax.py (2.8 µs for V = 128256 in a graph). Elsewhere two torch stages:
    torch's argmax along one long row ran as a single 36 µs reduction for V = 128256 (nvidia-h200, 2026-11-21);
    the max of each ~512-wide row, then of the row maxima, takes ~10 µs. Every index below is a tensor op
    (gather/where): indexing with a 0-d tensor would call .item(), a host sync per token.
    """
    v = logits.reshape(-1)
    if v.is_cuda and v.stride(0) == 1:
        return argmax_fwd(v)
    cols = _row_width(v.numel())
    rows = v.numel() // cols
    if rows < 2:
        return torch.argmax(v, dim=0, keepdim=True)
    best, where = v[: rows * cols].view(rows, cols).max(dim=1)  # [rows]: each row's max and first index in it
    r = torch.argmax(best, dim=0, keepdim=True)  # [1]: the first row holding the overall max
    head = r * cols + where.gather(0, r)  # [1]
    if rows * cols == v.numel():
        return head
    tail_max, tail_at = v[rows * cols:].max(dim=0, keepdim=True)  # [1] each; the tail lies after the head,
    return torch.where(tail_max > best.gather(0, r), rows * cols + tail_at, head)  # so it wins only when larger


def triton_usable(device: torch.device) -> bool:
    return device.type == "cuda" or (ops.INTERPRET and device.type == "cpu")


@dataclass
class RopeTables:
    cos: torch.Tensor  # [S, E/2] fp32, row p for position p
    sin: torch.Tensor  # [S, E/2] fp32


def _layers(ks: Kernels, w: Weights, cfg: LlamaConfig, x, cos, sin, cache_k, cache_v, positions, attend):
    """The decoder layers over the residual stream x [T, D]; returns final_norm(x) [T, D].

    `attend(i, q_rot)` -> [T, H, E] is the attention of layer i (the k/v are already in the cache).
    Each add_rms_norm adds the previous block's output into the stream and normalizes for the next block.
    """
    T, eps = x.shape[0], cfg.rms_norm_eps
    H, K, E = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    h = ks.rms_norm(x, w.layers[0].attn_norm, eps)
    for i, lw in enumerate(w.layers):
        qkv = F.linear(h, lw.qkv)  # [T, D] -> [T, (H+2K)·E]
        q = qkv[:, : H * E].view(T, H, E)
        k = qkv[:, H * E: (H + K) * E].view(T, K, E)
        v = qkv[:, (H + K) * E:].view(T, K, E)
        q_rot = ks.rope_kv_write(q, k, v, cos, sin, cache_k[i], cache_v[i], positions)  # k_rot, v -> cache
        a = attend(i, q_rot)  # [T, H, E]
        o = F.linear(a.reshape(T, H * E), lw.o)  # [T, H·E] -> [T, D]
        x, h = ks.add_rms_norm(o, x, lw.mlp_norm, eps)  # resid_mid, mlp_norm
        act = ks.swiglu_gate_up(F.linear(h, lw.gate_up))  # [T, D] -> [T, 2F] -> [T, F]
        down = F.linear(act, lw.down)  # [T, F] -> [T, D]
        next_norm = w.layers[i + 1].attn_norm if i + 1 < len(w.layers) else w.norm
        x, h = ks.add_rms_norm(down, x, next_norm, eps)  # resid_post, next attn_norm (or final_norm)
    return h


def prefill(ks: Kernels, w: Weights, cfg: LlamaConfig, ids, tables: RopeTables, cache_k, cache_v, start: int = 0):
    """ids [T] int on the device, a prompt at positions start..start+T-1 -> last-token logits [1, V] (model dtype).

    cache_k/cache_v [L, K, S, E]: slots start..start+T-1 of every layer are written; slots before start must
    already hold the earlier tokens (a chat continuing its history).
    """
    T = ids.shape[0]
    positions = torch.arange(start, start + T, device=ids.device)
    x = ks.embedding(ids, w.embed)  # [T, D]
    cos, sin = tables.cos[start:start + T], tables.sin[start:start + T]  # [T, E/2]

    def attend(i, q_rot):  # over the prompt's own k/v, which rope_kv_write has just put in the cache
        return ks.flash_attn(q_rot, cache_k[i], cache_v[i], positions)

    h = _layers(ks, w, cfg, x, cos, sin, cache_k, cache_v, positions, attend)
    return F.linear(h[-1:], w.lm_head)  # [1, D] -> [1, V]: only the next token's logits


def _decode_layers(ks: Kernels, w: Weights, cfg: LlamaConfig, x, cos, sin, cache_k, cache_v, position):
    """The decoder layers for one token, x [1, D] (updated in place), and the lm_head -> logits [1, V].

    Same values as `_layers` (the same roundings in the same order), with the GEMVs carrying the neighbours:
    attn norm + RoPE + cache write around the qkv GEMV, mlp norm in gate_up's prologue, SwiGLU in down's
    prologue, the residual adds in o/down's epilogue.
    """
    eps = cfg.rms_norm_eps
    H, E = cfg.num_attention_heads, cfg.head_dim
    for i, lw in enumerate(w.layers):
        q_rot = ks.qkv_rope(x, lw.attn_norm, lw.qkv, eps, cos, sin, position, cache_k[i], cache_v[i])  # [1, H, E]
        a = ks.decode_attn(q_rot, cache_k[i], cache_v[i], position)  # [1, H, E] over slots 0..position
        ks.linear_add(a.reshape(1, H * E), lw.o, x)  # x += o(a): resid_mid
        gate_up = ks.norm_linear(x, lw.mlp_norm, lw.gate_up, eps)  # [1, D] -> [1, 2F]
        ks.swiglu_linear_add(gate_up, lw.down, x)  # x += down(silu(gate)·up): resid_post
    # the final norm folded into the lm_head GEMV: 119.8 µs against rms_norm + cuBLAS's 129.4 on the 1B, 177.7
    # against 190.4 on the 3B (nvidia-h200, 2026-11-21, tools/bench/results/h200-2026-11-21-v6b-prefetch.json)
    return ks.norm_linear(x, w.norm, w.lm_head, eps)  # [1, D] -> [1, V]


def decode_step(ks: Kernels, w: Weights, cfg: LlamaConfig, token, position, tables: RopeTables, cache_k, cache_v):
    """token [1] int, position [1] int (both on the device) -> logits [1, V]. Capturable in a CUDA graph."""
    x = ks.embedding(token, w.embed)  # [1, D], a fresh buffer: the layers update it in place
    if ks.fused_qkv:  # the fused kernel reads row `position` of the tables itself
        cos, sin = tables.cos, tables.sin  # [S, E/2]
    else:
        cos, sin = tables.cos.index_select(0, position), tables.sin.index_select(0, position)  # [1, E/2]
    return _decode_layers(ks, w, cfg, x, cos, sin, cache_k, cache_v, position)
