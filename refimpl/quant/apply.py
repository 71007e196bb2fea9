"""Which tensors a `--quant` run quantizes: every linear layer, and the lm_head unless the spec says bf16-head.

The lm_head of a model with tied embeddings becomes its own quantized tensor (`lm_head.weight`) while the
embedding stays as loaded: the embedding is a row gather, one row a token, and reading it costs nothing.
"""
from __future__ import annotations

import numpy as np

from refimpl.model.config import LlamaConfig
from refimpl.progress import Progress
from refimpl.errors import QuantError
from refimpl.quant.schemes import MATRIX_KEYS, QuantizedLinear, QuantSpec

LINEAR_KEYS = tuple(f"{k}.weight" for k in MATRIX_KEYS if k != "lm_head")  # a block's, as the checkpoint names them
LM_HEAD = "lm_head.weight"

# The activation (refimpl.model.names, inside layer i) each group of linear layers multiplies.
SHARED_INPUT = {"attn_norm": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
                "attn.out": ("self_attn.o_proj.weight",),
                "mlp_norm": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
                "mlp.act": ("mlp.down_proj.weight",)}
NORMS = {"attn_norm": "input_layernorm.weight", "mlp_norm": "post_attention_layernorm.weight"}  # whose weight


def quantized_names(cfg: LlamaConfig, lm_head: bool) -> list[str]:
    names = [f"model.layers.{i}.{k}" for i in range(cfg.num_hidden_layers) for k in LINEAR_KEYS]
    return names + [LM_HEAD] if lm_head else names


def quantize_params(params: dict, cfg: LlamaConfig, spec: QuantSpec, quantize=None, label: str = "",
                    source="the checkpoint") -> dict:
    """fp32 params -> a new dict with the linear layers as QuantizedLinear (int8 / int4 specs), each matrix through
    `quantize(its one-format spec, w)` (default: round to nearest)."""
    refuse_requantizing(params, spec, source)
    out = dict(params)
    names = quantized_names(cfg, spec.lm_head)
    with Progress(f"quantizing to {spec}{label}", len(names)) as bar:
        for name in names:
            one = spec.for_matrix(name)
            out[name] = quantize(one, source_weight(params, name)) if quantize else one.quantize(
                source_weight(params, name))
            bar.advance()
    return out


def source_weight(params: dict, name: str) -> np.ndarray:
    """The fp32 matrix a quantized tensor is made from: a tied model's lm_head is its embedding."""
    return params[name] if name in params else params["model.embed_tokens.weight"]


def is_quantized(params: dict) -> bool:
    """Some parameter is a QuantizedLinear record (quantized at load, or a quantized checkpoint's)."""
    return any(isinstance(v, QuantizedLinear) for v in params.values())


def refuse_quantized(params: dict, source, advice: str) -> None:
    """A checkpoint `llama32 quantize` wrote runs as stored: quantizing (or rotating) its dequantized values again
    would only add error."""
    if is_quantized(params):
        raise QuantError(f"{source}: already quantized (by `llama32 quantize`); {advice}")


def refuse_requantizing(params: dict, spec: QuantSpec | None, source) -> None:
    """`--quant` on a checkpoint `llama32 quantize` wrote (GGUF blocks excepted: they are kept, not re-quantized)."""
    if spec is not None and spec.format != "gguf":
        refuse_quantized(params, source, f"drop --quant {spec}")


def dequantize_params(params: dict) -> dict:
    """Every QuantizedLinear replaced by its fp32 values (the same math, run once instead of every call)."""
    return {k: v.dequantize() if isinstance(v, QuantizedLinear) else v for k, v in params.items()}


def weight_values(w) -> np.ndarray:
    """A parameter as fp32 values: a QuantizedLinear dequantized, an array as it is."""
    return w.dequantize() if isinstance(w, QuantizedLinear) else w
