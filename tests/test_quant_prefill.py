"""The prefill's quantized kernels (accel/kernels/qdequant.py) against the oracle (refimpl.quant): dequantizing is
bit for bit refimpl's dequantize(); a quantized product of more rows (a dequantized scratch, then cuBLAS) is
"dequantize with the oracle, then multiply" up to fp32 summation error. Odd shapes: rows not a tile multiple, K not a
power of two, a short last group, G > K.

On CPU the kernels run under the interpreter (fp32, exact tl.dot); the GPU tests (skipped without CUDA) repeat them
on the device, in bf16 at the Llama 3.2 shapes.
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("gguf")

from accel.kernels.qdequant import dequantize_fwd  # noqa: E402
from accel import quant_layers  # noqa: E402
from accel.quant_layers import MATRICES, pack_layer, prefill_weights  # noqa: E402
from accel.quant_ops import from_quantized_linear, quantize, torch_dequantize  # noqa: E402
from accel.weights import LayerWeights  # noqa: E402
from refimpl.quant.schemes import QuantSpec  # noqa: E402
from test_quant_accel import RECORDS, bits, gguf_record, record  # noqa: E402

CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA")
interpreter = pytest.mark.skipif(CUDA, reason="CPU-interpreter coverage; the GPU's is below")


def dequantize(t, dtype=torch.float32, block=None):
    out = torch.full(t.shape, float("nan"), dtype=dtype, device=t.device)  # every element must be written
    return dequantize_fwd(t.q, t.scale, t.low, t.bits, t.offset, t.group, t.K, out, block=block)


def check_fp32(got, x, w):
    """got ≈ x @ w.T within fp32 summation error: |error| <= K·eps·Σ|x·w| (elementwise)."""
    want = x.astype(np.float64) @ w.astype(np.float64).T  # [M, K] @ [K, N] -> [M, N]
    bound = 4 * w.shape[1] * 2.0 ** -24 * (np.abs(x) @ np.abs(w).T) + 1e-7
    assert got.shape == want.shape
    assert (np.abs(got - want) <= bound).all(), f"max excess {np.max(np.abs(got - want) - bound):.3g}"


@interpreter
@pytest.mark.parametrize("name", list(RECORDS))
@pytest.mark.parametrize("block", [None, (8, 64, 4)], ids=["default", "small-tiles"])
def test_dequantize_kernel_equals_the_oracle_bit_for_bit(name, block):
    rec = RECORDS[name]
    t = from_quantized_linear(rec, "cpu")
    np.testing.assert_array_equal(bits(dequantize(t, block=block).numpy()), bits(rec.dequantize()))


@interpreter
def test_linear_of_several_rows_agrees_with_the_oracle():
    rec = RECORDS["int4:64"]
    t = from_quantized_linear(rec, "cpu")
    x = np.random.default_rng(8).standard_normal((2, 5, rec.shape[1])).astype(np.float32)  # [B, T, K]
    got = t.linear(torch.from_numpy(x)).numpy()
    assert got.shape == (2, 5, rec.shape[0])
    check_fp32(got.reshape(10, -1), x.reshape(10, -1), rec.dequantize())


# a layer's four matrices at odd shapes ([N, K]: qkv, o, gate_up, down; K multiples of 32 for the GGUF blocks, a
# short last int4 group at K = 96 and 224), in one format or mixed (one launch a format)
LAYER_SHAPES = {"qkv": (52, 96), "o": (37, 160), "gate_up": (70, 96), "down": (37, 224)}
LAYER_FORMATS = {"int8": ["int8"] * 4, "int4:64": ["int4:64"] * 4, "int4:32": ["int4:32"] * 4,
                 "mixed": ["int8", "int4:64", "int4:64", "int8"], "q4_1": ["q4_1"] * 4,
                 "q8_0+q4_0": ["q8_0", "q4_0", "q4_0", "q8_0"]}


def layer_records(formats, seed):
    recs = {}
    for i, (name, fmt) in enumerate(zip(MATRICES, formats)):
        N, K = LAYER_SHAPES[name]
        recs[name] = record(fmt, N, K, seed=seed + i)
    return recs


def quantized_layer(recs):
    norm = torch.ones(4)
    return LayerWeights(norm, *(from_quantized_linear(recs[n], "cpu") for n in ("qkv", "o")), norm,
                        *(from_quantized_linear(recs[n], "cpu") for n in ("gate_up", "down")))


@interpreter
@pytest.mark.parametrize("formats", list(LAYER_FORMATS))
def test_a_packed_layer_dequantizes_in_one_launch_a_format_to_the_oracle(formats):
    """pack_layer keeps every matrix's values (the decode GEMVs read the views); prefill_weights gives the oracle's
    dequantized matrices, bit for bit, from one launch a format, for two layers sharing one scratch in turn."""
    fmts = LAYER_FORMATS[formats]
    layers = [layer_records(fmts, seed) for seed in (20, 30)]
    packed = [pack_layer(quantized_layer(recs)) for recs in layers]
    assert len(packed[0].plan.launches) == len(set(fmts))
    for recs, lw in zip(layers, packed):
        for n in MATRICES:
            np.testing.assert_array_equal(bits(torch_dequantize(getattr(lw, n)).numpy()), bits(recs[n].dequantize()))
    x = torch.zeros(3, 4)
    quant_layers._LAYER_SCRATCH.clear()
    prefill_weights(packed[1], x)
    for flat in quant_layers._LAYER_SCRATCH.values():
        flat[0].fill_(float("nan"))  # every element of every view must be written
    for recs, lw in zip(layers, packed):
        dense = prefill_weights(lw, x)
        for n in MATRICES:
            got = getattr(dense, n)
            assert isinstance(got, torch.Tensor) and got.shape == LAYER_SHAPES[n]
            np.testing.assert_array_equal(bits(got.numpy()), bits(recs[n].dequantize()))
    assert prefill_weights(packed[0], x[:1]) is packed[0]  # one row: the GEMVs


@gpu
@pytest.mark.parametrize("spec", ["int8", "int4:32", "int4:64", "int4:128"])
@pytest.mark.parametrize("M, N, K", [(2048, 3072, 2048), (2048, 2048, 8192), (37, 5120, 3072), (300, 200, 200)])
def test_linear_gpu_bf16(spec, M, N, K):
    g = torch.Generator(device="cuda").manual_seed(M + N)
    t = quantize(torch.randn(N, K, device="cuda", generator=g) * 0.02, QuantSpec.parse(spec))
    x = torch.randn(M, K, device="cuda", generator=g).to(torch.bfloat16)
    w = dequantize(t, torch.bfloat16)  # the values the scratch holds
    np.testing.assert_array_equal(w.float().cpu().numpy(), dequantize(t).to(torch.bfloat16).float().cpu().numpy())
    want = x.double() @ w.double().T
    # bf16 output: one rounding of an fp32 sum, 2^-8 relative to the largest value
    via_scratch = t.linear(x).double()
    assert (via_scratch - want).abs().max().item() <= 2 ** -7 * want.abs().max().item()


@gpu
@pytest.mark.parametrize("spec", ["int8", "int4:64", "int4:128", "int4:64:mixed"])
@pytest.mark.parametrize("D, F, NQKV", [(2048, 8192, 3072), (3072, 8192, 5120)], ids=["1b", "3b"])
def test_packed_layer_at_llama_shapes_gpu(spec, D, F, NQKV):
    """At the real shapes (the aligned launch: 16-byte vectors): each matrix of the one-launch-a-format scratch
    equals the per-matrix dequantize (checked against the oracle above), and the decode GEMV reads the packed views
    as it read the separate matrices."""
    spec = QuantSpec.parse(spec)
    keys = {"qkv": "self_attn.q_proj", "o": "self_attn.o_proj", "gate_up": "mlp.gate_proj", "down": "mlp.down_proj"}
    shapes = {"qkv": (NQKV, D), "o": (D, D), "gate_up": (2 * F, D), "down": (D, F)}
    g = torch.Generator(device="cuda").manual_seed(D)
    ts = {n: quantize(torch.randn(*shapes[n], device="cuda", generator=g) * 0.02,
                      spec.for_matrix(f"model.layers.0.{keys[n]}.weight")) for n in MATRICES}
    want = {n: dequantize(t, torch.bfloat16) for n, t in ts.items()}
    x = torch.randn(1, D, device="cuda", generator=g).to(torch.bfloat16)
    gemv = {n: t.gemv(x) for n, t in ts.items() if n != "down"}
    norm = torch.ones(D, device="cuda", dtype=torch.bfloat16)
    lw = pack_layer(LayerWeights(norm, ts["qkv"], ts["o"], norm, ts["gate_up"], ts["down"]))
    assert len(lw.plan.launches) == (2 if spec.int8_keys else 1)
    assert all(launch.meta["ALIGNED"] for launch in lw.plan.launches)
    dense = prefill_weights(lw, torch.zeros(5, D, device="cuda", dtype=torch.bfloat16))
    for n in MATRICES:
        assert torch.equal(getattr(dense, n), want[n]), n
    for n, y in gemv.items():
        assert torch.equal(getattr(lw, n).gemv(x), y), n


@gpu
@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1"])
def test_gguf_blocks_dequantize_gpu(fmt):
    rec = gguf_record(fmt, 3072, 2048, seed=6)
    t = from_quantized_linear(rec, "cuda")
    np.testing.assert_array_equal(bits(dequantize(t).cpu().numpy()), bits(rec.dequantize()))
