"""The quantization oracle (refimpl.quant): GGUF blocks against the gguf library, int8/int4 by their definitions,
and quantized models through the refimpl and the GGUF loader."""
from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from refimpl.errors import CheckpointError  # noqa: E402
from refimpl.formats.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from refimpl.formats.params import random_params  # noqa: E402
from refimpl.model import ops  # noqa: E402
from refimpl.model.llama import KVCache, forward  # noqa: E402
from refimpl.quant.apply import dequantize_params, quantize_params  # noqa: E402
from refimpl.errors import QuantError  # noqa: E402
from refimpl.quant.schemes import (MIXED_INT8, QuantizedLinear, QuantSpec, pack_nibbles,  # noqa: E402
                                   quantize_int4, quantize_int8, round_bf16, unpack_nibbles)
from refimpl.quant.gguf_blocks import BLOCK_BYTES, dequantize_blocks  # noqa: E402
from test_gguf import tiny_config, write_gguf  # noqa: E402

Q = gguf.GGMLQuantizationType
QTYPES = {"q8_0": Q.Q8_0, "q4_0": Q.Q4_0, "q4_1": Q.Q4_1}


def edge_blocks(fmt: str, rng, n_blocks: int) -> np.ndarray:
    """Random bytes, with the fp16 fields set to edge values: ±0, subnormals, the largest finite, tiny, negative."""
    b = rng.integers(0, 256, size=(n_blocks, BLOCK_BYTES[fmt]), dtype=np.uint8)
    halves = np.array([0.0, -0.0, 6e-8, -6e-8, 65504.0, -65504.0, 1e-4, 0.5, -3.25, 1.0], np.float16)
    fields = 2 if fmt == "q4_1" else 1
    for f in range(fields):
        values = rng.choice(halves, size=n_blocks).astype(np.float16)
        random_half = rng.random(n_blocks) < 0.5  # half the blocks keep random (finite) fp16 bit patterns
        values[random_half] = rng.standard_normal(random_half.sum()).astype(np.float16)
        b[:, 2 * f: 2 * f + 2] = values.view(np.uint8).reshape(n_blocks, 2)
    b[0, 2 * fields:] = 0x00  # a block of all-minimum codes
    b[1, 2 * fields:] = 0xFF  # all-maximum (Q8_0: all -1)
    if fmt == "q8_0":
        b[2, 2:] = np.array([0x80, 0x7F] * 16, np.uint8)  # -128 and 127
    return b


@pytest.mark.parametrize("fmt", sorted(QTYPES))
def test_gguf_block_dequantize_matches_gguf_library(fmt):
    rng = np.random.default_rng(1)
    N, K = 7, 96
    blocks = edge_blocks(fmt, rng, N * K // 32).reshape(N, -1)  # [N, K/32 · B]
    ours = dequantize_blocks(fmt, blocks, (N, K))
    theirs = gguf.quants.dequantize(blocks, QTYPES[fmt])  # [N, K]
    assert theirs.shape == (N, K)
    np.testing.assert_array_equal(ours.view(np.uint32), theirs.astype(np.float32).view(np.uint32))


@pytest.mark.parametrize("fmt", sorted(QTYPES))
def test_gguf_blocks_of_quantized_weights_match_gguf_library(fmt):
    w = np.random.default_rng(2).standard_normal((5, 64)).astype(np.float32)
    blocks = gguf.quants.quantize(w, QTYPES[fmt])
    np.testing.assert_array_equal(dequantize_blocks(fmt, blocks, (5, 64)), gguf.quants.dequantize(blocks, QTYPES[fmt]))


def test_gguf_block_data_of_wrong_size_is_refused():
    with pytest.raises(QuantError, match="does not hold a"):
        dequantize_blocks("q4_1", np.zeros((2, 19), np.uint8), (2, 32))


def test_round_bf16_ties_to_even_like_torch():
    torch = pytest.importorskip("torch")
    x = np.concatenate([np.random.default_rng(3).standard_normal(1000).astype(np.float32),
                        np.array([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 0.0, 1e-40], np.float32)])
    np.testing.assert_array_equal(round_bf16(x), torch.from_numpy(x).to(torch.bfloat16).float().numpy())


def test_int8_by_hand():
    w = np.array([[0.5, -1.0, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0]], np.float32)
    q = quantize_int8(w)
    s = np.float32(round_bf16(np.float32(1.0) / np.float32(127)))
    assert q.scales[0, 0] == s and q.scales[1, 0] == 0
    expect = np.rint(np.float32([0.5, -1.0, 0.25, 0.0]) / s)
    np.testing.assert_array_equal(q.data[0], np.clip(expect, -127, 127))
    np.testing.assert_array_equal(q.data[1], 0)
    np.testing.assert_array_equal(q.dequantize()[1], 0)


def test_int4_by_hand_and_nibble_layout():
    w = np.array([[-1.0, 0.0, 0.5, 2.0]], np.float32)  # one group of 4 (G padded to a whole group)
    q = quantize_int4(w, 32)
    assert q.scales[0, 0] == np.float32(0.2001953125)  # bf16(3/15)
    assert q.mins[0, 0] == -1.0
    codes = unpack_nibbles(q.data)[0]
    np.testing.assert_array_equal(codes, [0, 5, 7, 15])  # rint((w+1)/0.2002): 0, 4.995, 7.49, 14.985
    assert q.data[0, 0] == 0 | 5 << 4 and q.data[0, 1] == 7 | 15 << 4  # even k in the low nibble
    c = np.random.default_rng(4).integers(0, 16, (3, 10), dtype=np.uint8)
    np.testing.assert_array_equal(unpack_nibbles(pack_nibbles(c)), c)


@pytest.mark.parametrize("G", [32, 64, 128])
def test_int4_error_within_half_a_step(G):
    w = np.random.default_rng(5).standard_normal((6, 200)).astype(np.float32)  # 200: a short last group
    q = quantize_int4(w, G)
    assert q.scales.shape == (6, -(-200 // G))
    err = np.abs(q.dequantize() - w)
    per_col = np.arange(200) // G
    # half a step, plus the bf16 rounding of the minimum (it shifts every level of the group)
    bound = q.scales[:, per_col] / 2 + np.abs(q.mins[:, per_col]) * 2 ** -8 + 1e-6
    assert (err <= bound).all()


def test_int8_error_within_half_a_step():
    w = np.random.default_rng(6).standard_normal((6, 100)).astype(np.float32)
    q = quantize_int8(w)
    assert (np.abs(q.dequantize() - w) <= q.scales / 2 * (1 + 1e-6)).all()


@pytest.mark.parametrize("text, want", [("int8", QuantSpec("int8")), ("int4", QuantSpec("int4", 64)),
                                        ("INT4:128", QuantSpec("int4", 128)),
                                        ("int4:32:bf16-head", QuantSpec("int4", 32, False)),
                                        ("int4:mixed", QuantSpec("int4", 64, True, MIXED_INT8)),
                                        ("int4:128:mixed:bf16-head", QuantSpec("int4", 128, False, MIXED_INT8)),
                                        ("int4:32:mixed(lm_head + mlp.down_proj):bf16-head",  # any order
                                         QuantSpec("int4", 32, False, ("mlp.down_proj", "lm_head"))),
                                        ("int4:mixed(mlp.gate_proj+mlp.up_proj)",
                                         QuantSpec("int4", 64, True, ("mlp.gate_proj", "mlp.up_proj"))),
                                        ("gguf", QuantSpec("gguf"))])
def test_quant_spec_parses(text, want):
    assert QuantSpec.parse(text) == want
    assert QuantSpec.parse(str(want)) == want


def test_non_default_int8_matrices_print_as_parse_reads_them():
    spec = QuantSpec("int4", 128, False, ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "lm_head"))
    assert str(spec) == "int4:128:mixed(self_attn.q_proj+self_attn.k_proj+self_attn.v_proj+lm_head):bf16-head"
    assert QuantSpec.parse(str(spec)) == spec


def test_mixed_spec_gives_each_matrix_one_format():
    spec = QuantSpec.parse("int4:32:mixed")  # q/k/v, down_proj and the lm_head in int8, as llama.cpp's Q4_K_M
    for name in ("model.layers.7.mlp.down_proj.weight", "model.layers.0.self_attn.v_proj.weight",
                 "model.layers.0.self_attn.q_proj.weight", "lm_head.weight"):
        assert spec.for_matrix(name) == QuantSpec("int8")
    for name in ("model.layers.7.mlp.up_proj.weight", "model.layers.7.mlp.gate_proj.weight",
                 "model.layers.0.self_attn.o_proj.weight"):
        assert spec.for_matrix(name) == QuantSpec("int4", 32)


@pytest.mark.parametrize("text", ["int3", "int4:48", "int8:32", "int4:x", "", "gguf:64", "int8:mixed", "mixed",
                                  "int4:mixed()", "int4:mixed(mlp.down)", "int4:mixed(self_attn.v_proj)",
                                  "int4:mixed(mlp.up_proj+lm_head)", "int8:mixed(lm_head)"])
def test_bad_quant_spec_is_one_clear_error(text):
    with pytest.raises(QuantError, match="--quant"):
        QuantSpec.parse(text)


@pytest.mark.parametrize("spec", ["int8", "int4:32", "int4:64:bf16-head"])
def test_quantized_forward_is_the_forward_of_dequantized_weights(spec):
    cfg = tiny_config(tied=True)
    params = random_params(cfg, seed=7)
    qp = quantize_params(params, cfg, QuantSpec.parse(spec))
    assert isinstance(qp.get("lm_head.weight"), QuantizedLinear) == (not spec.endswith("bf16-head"))
    assert isinstance(qp["model.layers.0.mlp.down_proj.weight"], QuantizedLinear)
    ids, pos = np.array([1, 5, 9]), np.arange(3)
    run = lambda p: forward(ops, p, cfg, ids, pos, KVCache.allocate(cfg, 4, lambda s: np.zeros(s, np.float32)))  # noqa
    got = run(qp)
    dq = dequantize_params(qp)
    if "lm_head.weight" not in dq:
        dq["lm_head.weight"] = dq["model.embed_tokens.weight"]
    np.testing.assert_array_equal(got, run(dq))
    assert np.abs(got - run(params)).max() > 0  # quantization did change the model


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1], ids=lambda q: q.name)
def test_gguf_blocks_kept_and_unpermuted(tmp_path, qtype):
    cfg = tiny_config(tied=True)
    params = random_params(cfg, seed=8)
    path = write_gguf(tmp_path / "m.gguf", cfg, params, qtype=qtype)
    plain = load_checkpoint(path, with_tokenizer=False)
    kept = load_checkpoint(path, with_tokenizer=False, quant=QuantSpec.parse("gguf"))
    q = kept.params["model.layers.0.self_attn.q_proj.weight"]
    assert isinstance(q, QuantizedLinear) and q.format == qtype.name.lower()
    assert kept.params["lm_head.weight"].format == qtype.name.lower()
    assert isinstance(kept.params["model.embed_tokens.weight"], np.ndarray)
    for name, value in kept.params.items():
        want = plain.params.get(name, plain.params["model.embed_tokens.weight"])
        got = value.dequantize() if isinstance(value, QuantizedLinear) else value
        np.testing.assert_array_equal(got, want, err_msg=name)


def test_gguf_quant_on_a_safetensors_directory_is_refused(tmp_path):
    cfg = tiny_config()
    save_checkpoint(tmp_path / "m", cfg, random_params(cfg))
    with pytest.raises(CheckpointError, match="--quant gguf"):
        load_checkpoint(tmp_path / "m", with_tokenizer=False, quant=QuantSpec.parse("gguf"))


@pytest.mark.parametrize("extra, needles", [(["--quant", "int4:48"], ["--quant", "int4 group"]),
                                            (["--quant", "gguf"], ["--quant gguf", "not a .gguf"])])
def test_cli_refuses_bad_quant_with_one_line(tmp_path, extra, needles):
    from _badinput import assert_clean_error, generate_args, make_model, run_cli
    assert_clean_error(run_cli(generate_args(make_model(tmp_path / "m"), *extra)), *needles)


def test_cli_generates_with_int8_on_the_refimpl(tmp_path):
    from _badinput import generate_args, make_model, run_cli
    result = run_cli(generate_args(make_model(tmp_path / "m"), "--quant", "int8", "--json"))
    assert result.exit_code == 0, result.output
    import json
    assert json.loads(result.stdout.splitlines()[-1])["quant"] == "int8"
