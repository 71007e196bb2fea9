"""transformers' attention interface over llama32's Triton FlashAttention (accel.train.attention.flash_attention).

`attention_forward` has the signature of transformers' `sdpa_attention_forward` and the same semantics, so a model
gives the same answers with `attn_implementation="llama32"` as with "sdpa":

    query [B, H, T, E], key/value [B, K, S, E] (K divides H; GQA stays native, K/V are never repeated)
    attention_mask None, or 4D [B or 1, 1, T or 1, S]: bool (True = may attend) or additive float (0 or a huge
    negative value) -> (out [B, T, H, E], None)

How the masks arrive (the mask interface registered for "llama32" is transformers' own `sdpa_mask`):
  * None: plain causal (no padding, and the queries start where the keys do: prefill, training) or a single query
    (cached decoding: it sees every key). As SDPA: causal iff T > 1 and the module is causal; causal is top-left,
    so keys past T (an empty static cache's tail) are never seen and are cropped.
  * bool [B, 1, T, S]: causal & padding, or the cached-decoding pattern (queries aligned to the end of the keys).
    Where the mask already hides every key past the query's index (top-left), the kernel also skips those blocks.
  * float [B, 1, T, S]: Llama 3.2 Vision's encoder mask (pad x pad) and its cross-attention mask; converted to
    bool (0 = visible), once per mask tensor.
Whatever the kernel cannot take runs transformers' SDPA function instead, with one warning per reason (the counts
are in `fallback_counts()`): head size past 128, key and value head sizes that differ, dtypes other than bf16 / fp32
(the kernels' tested ones), dropout, per-head masks, float masks that are not a 0 / -inf pattern or that hide every
key of a row (SDPA averages such a row; the kernel would give 0), position biases, sinks, soft-capping.
"""
from __future__ import annotations

import math
import warnings
from collections import Counter

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from accel.hf.memo import PerTensor
from accel.train.attention import flash_attention

MAX_HEAD_DIM = 128
DTYPES = (torch.bfloat16, torch.float32)
UNSUPPORTED_KWARGS = ("position_bias", "s_aux", "softcap")  # attention extras the kernel has no term for

_fallbacks: Counter = Counter()
_masks = PerTensor()  # mask -> (bool [B, T, S], causal) or the reason the kernel cannot take it


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention function for "llama32" (see the module docstring)."""
    reason = unsupported(query, key, value, attention_mask, dropout, kwargs)
    mask = causal = None
    if reason is None:
        T, S = query.shape[2], key.shape[2]
        if attention_mask is None:
            causal = T > 1 and (is_causal if is_causal is not None else getattr(module, "is_causal", True))
        else:
            plan = kernel_mask(attention_mask, query.shape[0], T, S)
            reason = plan if isinstance(plan, str) else None
            mask, causal = (None, None) if reason else plan
    if reason is not None:
        note_fallback(reason)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    if causal and mask is None and key.shape[2] > query.shape[2]:  # top-left causal never sees keys past T
        key, value = key[:, :, :query.shape[2]], value[:, :, :query.shape[2]]
    return _kernel_attention(query, key, value, mask, causal, scaling), None


@torch.compiler.disable  # opaque to torch.compile: the Triton kernels are already fused
def _kernel_attention(query, key, value, mask, causal, scaling):
    E = query.shape[-1]
    # the kernel scales by 1/sqrt(E); models pass E ** -0.5, whose product with sqrt(E) may be 1 ± 1 ulp (E = 128)
    if scaling is not None and not math.isclose(scaling * math.sqrt(E), 1.0, rel_tol=1e-12):
        query = query * (scaling * math.sqrt(E))
    # [B, H, T, E] -> [B, T, H, E] (views; the kernel takes any strides but the last) -> o [B, T, H, E]
    # contiguous, what the attention modules reshape to [B, T, H·E] (a view)
    return flash_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), causal, mask)


def unsupported(query, key, value, attention_mask, dropout: float, kwargs: dict) -> str | None:
    """Why the kernel cannot take this call (a short reason), or None where it can. Cheap: shapes and flags only."""
    if query.shape[-1] > MAX_HEAD_DIM:
        return f"head size {query.shape[-1]} > {MAX_HEAD_DIM}"
    if key.shape[-1] != query.shape[-1] or value.shape[-1] != query.shape[-1]:
        return "query, key and value head sizes differ"
    if query.dtype not in DTYPES or key.dtype != query.dtype or value.dtype != query.dtype:
        return f"dtype {query.dtype} / {key.dtype} / {value.dtype}"
    if query.shape[1] % key.shape[1] or key.shape[1] != value.shape[1]:
        return "query heads not a multiple of key/value heads"
    if dropout and dropout > 0.0:
        return "attention dropout"
    extras = [name for name in UNSUPPORTED_KWARGS if kwargs.get(name) is not None]
    if extras:
        return f"{extras[0]} given"
    if attention_mask is not None and (attention_mask.dim() != 4 or attention_mask.shape[1] != 1):
        return f"mask of shape {list(attention_mask.shape)} (per-head or not 4D)"
    return None


def kernel_mask(attention_mask: torch.Tensor, B: int, T: int, S: int):
    """A 4D transformers mask [B or 1, 1, T or 1, S] -> (bool [B, T, S] (a view, expanded where it broadcasts),
    causal: whether it already hides every key past the query's index, so the kernel may skip those blocks),
    or a str: why the kernel cannot take it. Derived once per mask tensor: models pass one mask to every layer."""
    return _masks.get((attention_mask,), (B, T, S), lambda: _derive(attention_mask, B, T, S))


def _derive(attention_mask: torch.Tensor, B: int, T: int, S: int):
    m = attention_mask[:, 0]  # [B or 1, T or 1, S]
    if m.shape[-1] != S or m.shape[0] not in (1, B) or m.shape[1] not in (1, T):
        return f"mask of shape {list(attention_mask.shape)} for T={T}, S={S}"
    m = m.expand(B, T, S)
    if m.dtype != torch.bool:
        if not m.is_floating_point():
            return f"mask of dtype {m.dtype}"
        visible = m == 0
        if not bool((visible | (m <= torch.finfo(m.dtype).min / 2)).all()):
            return "float mask with values other than 0 and -inf (a bias)"
        if not bool(visible.any(dim=-1).all()):
            return "float mask hiding every key of a row"
        m = visible
    causal = T > 1 and not bool(torch.triu(m, diagonal=1).any())
    return m, causal


def note_fallback(reason: str) -> None:
    """Count a fallback to SDPA; warn the first time each reason occurs."""
    _fallbacks[reason] += 1
    if _fallbacks[reason] == 1:
        warnings.warn(f"llama32 attention: {reason}; this call (and others like it) runs transformers' SDPA",
                      stacklevel=3)


def fallback_counts() -> dict[str, int]:
    """{reason: calls that fell back to SDPA for it} since the start (or the last reset_fallbacks())."""
    return dict(_fallbacks)


def reset_fallbacks() -> None:
    """Forget the counts, so each reason warns once more."""
    _fallbacks.clear()
