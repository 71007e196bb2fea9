"""Quantizing a whole model offline, with or without calibration text.

    rtn     round to nearest on the min/max range (refimpl.quant.schemes; what `--quant` does at load time)
    search  error-minimizing ranges (refimpl.quant.search); with calibration, each column's error weighted by the
            mean square of its input (llama.cpp's importance matrix)
    gptq    GPTQ (refimpl.quant.gptq) on each layer's calibration Hessian, with searched ranges
    awq     activation-aware scales (refimpl.quant.awq) folded into the preceding ops, then search
    awq-gptq  the same scales, then GPTQ on the scaled weights and the Hessians of the divided inputs

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
from refimpl.quant import awq
from refimpl.quant.apply import LM_HEAD, NORMS, SHARED_INPUT, quantize_params, refuse_quantized, source_weight
from refimpl.errors import QuantError
from refimpl.quant.schemes import QuantizedLinear, QuantSpec
from refimpl.quant.gptq import gptq_quantize
from refimpl.quant.search import importance_of, quantize_search

METHODS = ("rtn", "search", "gptq", "awq", "awq-gptq")
SEQ_LEN = 512  # calibration tokens a sequence (the first is BOS)

FOLDED = tuple(NORMS.values())  # AWQ changes them (v, up: quantized)


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
    """One matrix [Dout, Din]; h = Σ xᵀx [Din, Din] over its calibration inputs, or None. method: rtn, search,
    gptq (the AWQ methods scale first, then run search / gptq here)."""
    if method == "rtn":
        return spec.quantize(w)
    if method == "search":
        return quantize_search(spec, w, None if h is None else importance_of(h))
    if h is None:
        raise QuantError("--method gptq needs calibration text (--calib FILE)")
    return gptq_quantize(w, h, spec)


def quantize_shared(ws: list[np.ndarray], h: np.ndarray | None, spec: QuantSpec, method: str) -> list:
    """Matrices that multiply one input, stacked by rows and quantized at once (every method treats rows
    independently: one GPTQ sweep and one Hessian factorization serve all), then split again."""
    q = quantize_matrix(np.concatenate(ws) if len(ws) > 1 else ws[0], h, spec, method)
    ends = np.cumsum([len(w) for w in ws])  # [n]: each matrix's last row + 1
    return [q] if len(ws) == 1 else [q.take_rows(np.arange(e - len(w), e)) for w, e in zip(ws, ends)]


def _awq_layer(p: dict, grams: dict, cfg: LlamaConfig, i: int, spec: QuantSpec) -> tuple[dict, dict]:
    """AWQ on one layer: its params with the scales folded in, and the Hessians of the divided inputs."""
    scales = {}
    for act, keys in SHARED_INPUT.items():
        w = np.concatenate([p[k] for k in keys])  # [ΣDout, Din]
        one = spec.for_matrix(f"model.layers.{i}.{keys[0]}")
        scales[act] = awq.search_scales(w, grams[act], one.quantize, awq.tied_columns(cfg) if act == "attn.out"
                                        else None)
    folded = awq.fold(p, {"qkv": scales["attn_norm"], "o": scales["attn.out"][_first_of_tie(cfg)],
                          "gate_up": scales["mlp_norm"], "down": scales["mlp.act"]}, cfg)
    return folded, {act: awq.scaled_hessian(grams[act], scales[act]) for act in SHARED_INPUT}


def _first_of_tie(cfg: LlamaConfig) -> np.ndarray:
    """For each v row, one o_proj column that reads it (the first query head of its group), [K·E]."""
    tie = awq.tied_columns(cfg)
    return np.unique(tie, return_index=True)[1]


def quantize_model(params: dict, cfg: LlamaConfig, spec: QuantSpec, method: str,
                   sequences: list[np.ndarray] | None = None) -> dict:
    """fp32 params -> a new dict with every linear layer (and the lm_head unless spec says bf16-head) a
    QuantizedLinear. `sequences`: calibration token ids (calibration_sequences), or None for rtn / plain search.
    The AWQ methods also change the RMSNorm weights and v/up rows they fold the scales into (module awq)."""
    if method not in METHODS:
        raise QuantError(f"--method {method!r}: expected one of {', '.join(METHODS)}")
    if spec.format not in ("int8", "int4"):
        raise QuantError(f"--quant {spec}: offline quantization writes int8 or int4:G")
    refuse_quantized(params, "--model", "quantize the original checkpoint")
    if sequences is None or method == "rtn":
        if method.startswith("awq"):
            raise QuantError(f"--method {method} needs calibration text (--calib FILE)")
        return quantize_params(params, cfg, spec, lambda one, w: quantize_matrix(w, None, one, method), f" ({method})")
    use_awq, base = method.startswith("awq"), {"awq": "search", "awq-gptq": "gptq"}.get(method, method)
    out = dict(params)
    streams = [_Stream(np.arange(len(ids)), ops.embedding(ids, params["model.embed_tokens.weight"]),
                       *ops.rope_tables(np.arange(len(ids)), cfg.head_dim, cfg.rope_theta, cfg.rope_scaling),
                       KVCache.allocate(cfg, len(ids), lambda shape: np.zeros(shape, np.float32)))
               for ids in sequences]
    wanted = {f"layers.{i}.{a}" for i in range(cfg.num_hidden_layers) for a in SHARED_INPUT}
    with Progress(f"quantizing to {spec} ({method}, {sum(len(s) for s in sequences)} calibration tokens)",
                  cfg.num_hidden_layers + spec.lm_head, lines_s=0.0) as bar:
        for i in range(cfg.num_hidden_layers):
            grams: dict[str, np.ndarray] = {}
            p = layer_params(params, i)
            for s in streams:  # the layer's original weights, on the quantized model's stream
                acts, _ = drive(_layer(p, s, cfg, i), lambda name: name in wanted)
                for name, x in acts.items():
                    key = name.split(".", 2)[2]
                    grams[key] = grams.get(key, 0) + _gram(x)
            if use_awq:
                p, grams = _awq_layer(p, grams, cfg, i, spec)
            for act, keys in SHARED_INPUT.items():
                names = [f"model.layers.{i}.{k}" for k in keys]
                for one in {spec.for_matrix(n) for n in names}:  # one format a fused group (module formats)
                    mine = [k for k, n in zip(keys, names) if spec.for_matrix(n) == one]
                    for key, q in zip(mine, quantize_shared([p[k] for k in mine], grams[act], one, base)):
                        out[f"model.layers.{i}.{key}"] = q
            for key in FOLDED:
                out[f"model.layers.{i}.{key}"] = p[key]
            for s in streams:  # the stream through the quantized layer feeds the next one
                _, s.x = drive(_layer(layer_params(out, i), s, cfg, i), lambda name: False)
            bar.advance(1, f"layer {i}")
        if spec.lm_head:
            head, norm = source_weight(params, LM_HEAD), params["model.norm.weight"]
            h = sum(_gram(ops.rms_norm(s.x, norm, cfg.rms_norm_eps)) for s in streams)
            one = spec.for_matrix(LM_HEAD)
            if use_awq:
                sc = awq.search_scales(head, h, one.quantize)
                head, h, out["model.norm.weight"] = head * sc, awq.scaled_hessian(h, sc), norm / sc
            out[LM_HEAD] = quantize_matrix(head, h, one, base)
            bar.advance(1, "lm_head")
    return out
