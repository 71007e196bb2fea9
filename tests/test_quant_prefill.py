"""The prefill's quantized kernels (accel/kernels/qdequant.py) against the oracle (refimpl.quant): dequantizing is
bit for bit refimpl's dequantize(); the fused GEMM is "dequantize with the oracle, then multiply" up to fp32
summation error. Odd shapes: rows not a tile multiple, K not a power of two, a short last group, G > K.

On CPU the kernels run under the interpreter (fp32, exact tl.dot); the GPU tests (skipped without CUDA) repeat them
on the device, in bf16 at the Llama 3.2 shapes.
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("gguf")

from accel.kernels.qdequant import QGemmConfig, dequantize_fwd, qgemm_fwd  # noqa: E402
from accel.quant_ops import from_quantized_linear, prefill_path, quant_linear, quantize  # noqa: E402
from refimpl.quant.formats import QuantSpec  # noqa: E402
from test_quant_accel import RECORDS, bits, gguf_record  # noqa: E402

CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA")
interpreter = pytest.mark.skipif(CUDA, reason="CPU-interpreter coverage; the GPU's is below")


def dequantize(t, dtype=torch.float32, block=None):
    out = torch.full(t.shape, float("nan"), dtype=dtype, device=t.device)  # every element must be written
    return dequantize_fwd(t.q, t.scale, t.low, t.bits, t.offset, t.group, t.K, out, block=block)


def gemm(t, x, config=None):
    return qgemm_fwd(x, t.q, t.scale, t.low, t.bits, t.offset, t.group, t.K, config=config)


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
@pytest.mark.parametrize("name", list(RECORDS))
@pytest.mark.parametrize("M, config", [(19, None), (1, None), (37, QGemmConfig(16, 16, 32, 4, 1, 2))],
                         ids=["M19", "M1", "M37-small-tiles-partial-band"])
def test_quantized_gemm_is_dequantize_then_multiply(name, M, config):
    rec = RECORDS[name]
    t = from_quantized_linear(rec, "cpu")
    x = np.random.default_rng(7).standard_normal((M, rec.shape[1])).astype(np.float32)
    got = gemm(t, torch.from_numpy(x), config).numpy()
    check_fp32(got, x, rec.dequantize())


@interpreter
@pytest.mark.parametrize("path", ["gemm", "dequant"])
def test_quant_linear_prefill_paths_agree_with_the_oracle(path):
    rec = RECORDS["int4:64"]
    t = from_quantized_linear(rec, "cpu")
    x = np.random.default_rng(8).standard_normal((2, 5, rec.shape[1])).astype(np.float32)  # [B, T, K]
    with prefill_path(path):
        got = quant_linear(torch.from_numpy(x), t).numpy()
    assert got.shape == (2, 5, rec.shape[0])
    check_fp32(got.reshape(10, -1), x.reshape(10, -1), rec.dequantize())


@gpu
@pytest.mark.parametrize("spec", ["int8", "int4:32", "int4:64", "int4:128"])
@pytest.mark.parametrize("M, N, K", [(2048, 3072, 2048), (2048, 2048, 8192), (37, 5120, 3072), (300, 200, 200)])
def test_quantized_gemm_gpu_bf16(spec, M, N, K):
    g = torch.Generator(device="cuda").manual_seed(M + N)
    t = quantize(torch.randn(N, K, device="cuda", generator=g) * 0.02, QuantSpec.parse(spec))
    x = torch.randn(M, K, device="cuda", generator=g).to(torch.bfloat16)
    w = dequantize(t, torch.bfloat16)  # the values the fused GEMM rounds its tiles to
    np.testing.assert_array_equal(w.float().cpu().numpy(), dequantize(t).to(torch.bfloat16).float().cpu().numpy())
    want = x.double() @ w.double().T
    got = gemm(t, x).double()
    # bf16 output: one rounding of an fp32 sum, 2^-8 relative to the largest value
    assert (got - want).abs().max().item() <= 2 ** -7 * want.abs().max().item()
    with prefill_path("dequant"):
        via_scratch = quant_linear(x, t).double()
    assert (via_scratch - want).abs().max().item() <= 2 ** -7 * want.abs().max().item()


@gpu
@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1"])
def test_gguf_blocks_dequantize_and_gemm_gpu(fmt):
    rec = gguf_record(fmt, 3072, 2048, seed=6)
    t = from_quantized_linear(rec, "cuda")
    np.testing.assert_array_equal(bits(dequantize(t).cpu().numpy()), bits(rec.dequantize()))
    x = np.random.default_rng(9).standard_normal((77, 2048)).astype(np.float32)
    got = gemm(t, torch.from_numpy(x).cuda(), QGemmConfig(64, 128, 64, 4, 3)).cpu().numpy()  # fp32: IEEE dots
    check_fp32(got, x, rec.dequantize())
