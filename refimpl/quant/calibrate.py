"""Quantizing a whole model offline, with or without calibration text.

    rtn     round to nearest on the min/max range (refimpl.quant.formats; what `--quant` does at load time)
    search  error-minimizing ranges (refimpl.quant.search); with calibration, each column's error weighted by the
            mean square of its input (llama.cpp's importance matrix)
    gptq    GPTQ (refimpl.quant.gptq) on each layer's calibration Hessian, with searched ranges

With calibration the model is walked layer by layer, as GPTQ's reference does: every calibration sequence's
residual stream enters layer i; one pass with the layer's original weights records the inputs of its seven linear
layers (q/k/v share the attention norm's output, gate/up the MLP norm's); the layer is quantized; a second pass
with the quantized layer gives the stream that enters layer i + 1, so later layers are calibrated on what the
quantized model really computes. The lm_head is calibrated on the final norm's output last.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from refimpl.model import ops
from refimpl.model.config import LlamaConfig
from refimpl.model.llama import KVCache, attention_block, drive, layer_params, mlp_block
from refimpl.progress import Progress
from refimpl.quant.apply import LINEAR_KEYS, LM_HEAD, is_quantized, quantize_params, quantized_names, source_weight
from refimpl.quant.formats import QuantError, QuantizedLinear, QuantSpec
from refimpl.quant.gptq import gptq_quantize
from refimpl.quant.search import importance_of, quantize_search

METHODS = ("rtn", "search", "gptq")
SEQ_LEN = 512  # calibration tokens a sequence (the first is BOS)

# The activation (refimpl.model.names, inside layer i) each linear layer multiplies.
INPUT_OF = {"self_attn.q_proj.weight": "attn_norm", "self_attn.k_proj.weight": "attn_norm",
            "self_attn.v_proj.weight": "attn_norm", "self_attn.o_proj.weight": "attn.out",
            "mlp.gate_proj.weight": "mlp_norm", "mlp.up_proj.weight": "mlp_norm", "mlp.down_proj.weight": "mlp.act"}


def calibration_sequences(tokenizer, text: str, seq_len: int = SEQ_LEN) -> list[np.ndarray]:
    """The text's tokens cut into sequences of seq_len, each led by BOS (as every prompt is)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    step = seq_len - len(bos)
    seqs = [np.asarray(bos + ids[i:i + step], np.int64) for i in range(0, len(ids), step)]
    seqs = [s for s in seqs if len(s) >= 16]  # a short tail adds noise, not coverage
    if not seqs:
        raise QuantError(f"the calibration text has {len(ids)} tokens; give it at least a few hundred")
    return seqs


@dataclass
class _Stream:
    """One calibration sequence as it flows through the model."""

    positions: np.ndarray  # [T]
    x: np.ndarray  # [T, D], the residual stream entering the next layer
    cos: np.ndarray  # [T, E/2]
    sin: np.ndarray
    cache: KVCache


def _layer(p: dict, s: _Stream, cfg: LlamaConfig, i: int):
    x = yield from attention_block(ops, p, s.x, cfg, i, s.cos, s.sin, s.cache, s.positions)
    return (yield from mlp_block(ops, p, x, cfg, i))


def _gram(x: np.ndarray) -> np.ndarray:
    x = x.reshape(x.shape[0], -1).astype(np.float64)  # [T, ...] -> [T, Din]
    return x.T @ x  # [Din, T] @ [T, Din] -> [Din, Din]


def quantize_matrix(w: np.ndarray, h: np.ndarray | None, spec: QuantSpec, method: str) -> QuantizedLinear:
    """One matrix [Dout, Din]; h = Σ xᵀx [Din, Din] over its calibration inputs, or None."""
    if method == "rtn":
        return spec.quantize(w)
    if method == "search":
        return quantize_search(spec, w, None if h is None else importance_of(h))
    if h is None:
        raise QuantError("--method gptq needs calibration text (--calib FILE)")
    return gptq_quantize(w, h, spec)


def quantize_model(params: dict, cfg: LlamaConfig, spec: QuantSpec, method: str,
                   sequences: list[np.ndarray] | None = None) -> dict:
    """fp32 params -> a new dict with every linear layer (and the lm_head unless spec says bf16-head) a
    QuantizedLinear. `sequences`: calibration token ids (calibration_sequences), or None for rtn / plain search."""
    if method not in METHODS:
        raise QuantError(f"--method {method!r}: expected one of {', '.join(METHODS)}")
    if spec.format not in ("int8", "int4"):
        raise QuantError(f"--quant {spec}: offline quantization writes int8 or int4:G")
    if is_quantized(params):
        raise QuantError("--model: already quantized (by `llama32 quantize`); quantize the original checkpoint")
    names = quantized_names(cfg, spec.lm_head)
    out = dict(params)
    if sequences is None or method == "rtn":
        return quantize_params(params, cfg, spec, lambda w: quantize_matrix(w, None, spec, method), f" ({method})")
    streams = [_Stream(np.arange(len(ids)), ops.embedding(ids, params["model.embed_tokens.weight"]),
                       *ops.rope_tables(np.arange(len(ids)), cfg.head_dim, cfg.rope_theta, cfg.rope_scaling),
                       KVCache.allocate(cfg, len(ids), lambda shape: np.zeros(shape, np.float32)))
               for ids in sequences]
    wanted = {f"layers.{i}.{a}" for i in range(cfg.num_hidden_layers) for a in set(INPUT_OF.values())}
    with Progress(f"quantizing to {spec} ({method}, {sum(len(s) for s in sequences)} calibration tokens)",
                  cfg.num_hidden_layers + spec.lm_head) as bar:
        for i in range(cfg.num_hidden_layers):
            grams: dict[str, np.ndarray] = {}
            for s in streams:  # the layer's original weights, on the quantized model's stream
                acts, _ = drive(_layer(layer_params(params, i), s, cfg, i), lambda name: name in wanted)
                for name, x in acts.items():
                    key = name.split(".", 2)[2]
                    grams[key] = grams.get(key, 0) + _gram(x)
            for key in LINEAR_KEYS:
                name = f"model.layers.{i}.{key}"
                out[name] = quantize_matrix(params[name], grams[INPUT_OF[key]], spec, method)
            for s in streams:  # the stream through the quantized layer feeds the next one
                _, s.x = drive(_layer(layer_params(out, i), s, cfg, i), lambda name: False)
            bar.advance()
        if spec.lm_head:
            h = sum(_gram(ops.rms_norm(s.x, params["model.norm.weight"], cfg.rms_norm_eps)) for s in streams)
            out[LM_HEAD] = quantize_matrix(source_weight(params, LM_HEAD), h, spec, method)
            bar.advance()
    return out
