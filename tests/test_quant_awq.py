"""Activation-aware scaling (refimpl.quant.awq) and the calibrated driver's shared-input quantization, against
independent computations: the unscaled model's own forward (a fold must not change what the model computes), the
layer output error measured on the inputs themselves, and each matrix quantized on its own."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from refimpl.compare import TOLERANCES, compare
from refimpl.formats.checkpoint import load_checkpoint
from refimpl.model import ops
from refimpl.model.llama import KVCache, forward, layer_params
from refimpl.quant import awq
from refimpl.quant.calibrate import calibration_sequences, quantize_model, quantize_shared
from refimpl.quant.schemes import QuantSpec
from test_quant_methods import correlated_inputs, heavy_tailed, output_error

TOY = Path(__file__).resolve().parent.parent / "golden" / "toy-gqa"  # 4 query heads over 2 kv heads
CALIB = ("Call me Ishmael. Some years ago, having little or no money in my purse, and nothing particular to interest "
         "me on shore, I thought I would sail about a little and see the watery part of the world. ") * 6


def logits(params, cfg, ids):
    cache = KVCache.allocate(cfg, len(ids), lambda s: np.zeros(s, np.float32))
    return forward(ops, params, cfg, np.asarray(ids), np.arange(len(ids)), cache)


def with_layers(params, cfg, layer_of):
    """params with each layer's tensors replaced by layer_of(i, layer_params(params, i))."""
    out = dict(params)
    for i in range(cfg.num_hidden_layers):
        out.update({f"model.layers.{i}.{k}": v for k, v in layer_of(i, layer_params(params, i)).items()})
    return out


def test_fold_leaves_the_unquantized_model_unchanged():
    """Random scales in [0.2, 5] at all four places, every layer: the logits stay those of the original weights."""
    src = load_checkpoint(TOY)
    cfg, rng = src.config, np.random.default_rng(0)
    sizes = {"qkv": cfg.hidden_size, "o": cfg.kv_size, "gate_up": cfg.hidden_size, "down": cfg.intermediate_size}

    def scaled(i, p):
        return awq.fold(p, {k: rng.uniform(0.2, 5, n).astype(np.float32) for k, n in sizes.items()}, cfg)

    folded = with_layers(src.params, cfg, scaled)
    ids = rng.integers(0, cfg.vocab_size, 24)
    assert not np.allclose(folded["model.layers.0.self_attn.o_proj.weight"],
                           src.params["model.layers.0.self_attn.o_proj.weight"])
    c = compare("logits", logits(folded, cfg, ids), logits(src.params, cfg, ids), TOLERANCES["fp32"])
    assert c.ok, c


def test_tied_columns_follow_grouped_query_attention():
    cfg = load_checkpoint(TOY).config  # H = 4, K = 2, E = 16: query heads 0, 1 read kv head 0; 2, 3 kv head 1
    tie = awq.tied_columns(cfg)
    assert tie.shape == (64,)
    assert list(tie[[0, 15, 16, 31, 32, 47, 48, 63]]) == [0, 15, 0, 15, 16, 31, 16, 31]


@pytest.mark.parametrize("spec", [QuantSpec("int8"), QuantSpec("int4", 32)])
def test_searched_scales_lower_the_layer_output_error(spec):
    """Inputs with a few large columns: the chosen scales beat no scaling (α = 0) on the output error measured on
    the inputs themselves, and scale those columns up."""
    w = heavy_tailed((48, 96), seed=11)
    x = correlated_inputs(300, 96, seed=12, outliers=(5, 40, 71))
    h = x.T.astype(np.float64) @ x  # [K, K]
    s = awq.search_scales(w, h, spec.quantize)
    plain = output_error(w, spec.quantize(w), x)
    d = (w.astype(np.float64) - spec.quantize(w * s).values / s) @ x.T.astype(np.float64)  # [N, T]
    assert float((d * d).sum()) < 0.9 * plain
    assert s[[5, 40, 71]].min() > np.median(s)
    np.testing.assert_allclose(awq.output_error(w, np.ones(96, np.float32), h, spec.quantize), plain, rtol=1e-5)


@pytest.mark.parametrize("spec", [QuantSpec("int8"), QuantSpec("int4", 32)])
def test_output_error_in_row_chunks_is_the_whole_matrix_error(spec):
    """Chunks of 7 rows of a 50-row matrix (the last one short), fp32 products: ‖(W − Q(W·s)/s) Xᵀ‖², measured in
    float64 on the inputs themselves."""
    w = heavy_tailed((50, 64), seed=13)
    x = correlated_inputs(200, 64, seed=14, outliers=(3, 30))
    h = x.T.astype(np.float64) @ x  # [K, K]
    s = np.random.default_rng(15).uniform(0.5, 2.0, 64).astype(np.float32)  # [K]
    d = (w.astype(np.float64) - spec.quantize(w * s).values / s) @ x.T.astype(np.float64)  # [N, T]
    want = float((d * d).sum())
    np.testing.assert_allclose(awq.output_error(w, s, h, spec.quantize, rows=7), want, rtol=1e-5)
    np.testing.assert_allclose(awq.output_error(w, s, h, spec.quantize, rows=7),
                               awq.output_error(w, s, h, spec.quantize, rows=50), rtol=1e-6)


def test_shared_input_quantization_equals_each_matrix_alone():
    """Stacking q/k/v by rows gives each matrix the codes and grid it gets alone (GPTQ and the search treat rows
    independently)."""
    ws = [heavy_tailed((n, 64), seed=20 + n) for n in (32, 16, 16)]
    x = correlated_inputs(200, 64, seed=30)
    h = x.T.astype(np.float64) @ x
    spec = QuantSpec("int4", 32)
    for method in ("search", "gptq"):
        together = quantize_shared(ws, h, spec, method)
        for w, got in zip(ws, together):
            alone = quantize_shared([w], h, spec, method)[0]
            assert got.shape == alone.shape and np.array_equal(got.scales, alone.scales)
            assert np.mean(got.data == alone.data) > 0.999  # a BLAS summation order may flip an exact tie


def test_awq_methods_fold_into_the_norms_and_track_the_model():
    """awq-gptq on the toy model: the norms and v/up rows carry the scales, the scales layer 0's norm carries cut
    its q/k/v round-to-nearest error on the calibration inputs (measured here) below no scaling's, and the body's
    logits are closer to the unquantized model's than round-to-nearest's."""
    src = load_checkpoint(TOY)
    cfg, spec = src.config, QuantSpec.parse("int4:32")
    seqs = calibration_sequences(src.tokenizer, CALIB, seq_len=128)
    ids = src.tokenizer.encode("It was the best of times, it was the worst of times.")
    ref = logits(src.params, cfg, ids)
    q = quantize_model(src.params, cfg, spec, "awq-gptq", seqs)
    assert not np.array_equal(q["model.layers.0.input_layernorm.weight"],
                              src.params["model.layers.0.input_layernorm.weight"])
    assert not np.array_equal(q["model.norm.weight"], src.params["model.norm.weight"])  # the quantized head's
    assert np.array_equal(q["model.embed_tokens.weight"], src.params["model.embed_tokens.weight"])
    norm = "model.layers.0.input_layernorm.weight"  # layer 0's input is the unquantized embedding's
    s = src.params[norm] / q[norm]  # [D]: the folded scales
    x = np.concatenate([ops.rms_norm(ops.embedding(ids_, src.params["model.embed_tokens.weight"]), src.params[norm],
                                     cfg.rms_norm_eps) for ids_ in seqs]).astype(np.float64)  # [T, D]
    w = np.concatenate([src.params[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv"])  # [ΣDout, D]

    def rtn_error(scale):  # ‖(W − Q(W·s)/s) Xᵀ‖², on the inputs themselves
        d = (w.astype(np.float64) - spec.quantize(w * scale).values / scale) @ x.T  # [ΣDout, T]
        return float((d * d).sum())

    assert rtn_error(s) < 0.95 * rtn_error(np.ones_like(s))
    err = {"awq-gptq": np.mean((logits(q, cfg, ids) - ref) ** 2),
           "rtn": np.mean((logits(quantize_model(src.params, cfg, spec, "rtn"), cfg, ids) - ref) ** 2)}
    assert err["awq-gptq"] < err["rtn"]
