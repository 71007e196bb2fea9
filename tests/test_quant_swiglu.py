"""The quantized decode MLP with the SwiGLU in gate_up's epilogue (accel.kernels.qgemv_fused.gate_up_swiglu_qfwd, the
op accel.ops.norm_mlp_add) against "dequantize with the oracle, norm, gate_up matmul, silu(gate)·up, down".

On CPU the kernel runs under the interpreter (fp32); the GPU test (skipped without CUDA) runs it at the Llama 3.2
shapes in bf16, against the same math in fp64 rounded where the unfused bf16 path rounds.
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from accel import ops  # noqa: E402
from accel.kernels.qgemv_fused import gate_up_swiglu_qfwd  # noqa: E402
from accel.quant_ops import QuantTensor, from_quantized_linear, quantize  # noqa: E402
from refimpl.model import ops as np_ops  # noqa: E402
from refimpl.quant.schemes import QuantSpec  # noqa: E402
from test_quant_accel import gpu, interpreter, record  # noqa: E402

EPS = 1e-5


def launch(t: QuantTensor, x, nw, **kw):
    return gate_up_swiglu_qfwd(t.q, t.scale, t.low, t.bits, t.offset, t.group, t.K, x, nw, EPS, **kw)


def oracle_swiglu(w_deq: np.ndarray, x: np.ndarray, nw: np.ndarray):
    """-> (silu(g)·u [F], a bound on its fp32 error) with g, u = W_deq @ rms_norm(x) in fp64; the bound carries
    the GEMV's fp32 summation error (K·eps·Σ|w·h| a row) through silu (|silu'| <= 1.1) and the product."""
    F = w_deq.shape[0] // 2
    h = np_ops.rms_norm(x[None], nw, EPS)[0].astype(np.float64)  # [D]
    gu = w_deq.astype(np.float64) @ h  # [2F, D] @ [D] -> [2F]
    err = 4 * w_deq.shape[1] * 2.0 ** -24 * (np.abs(w_deq) @ np.abs(h)) + 1e-7  # [2F]
    g, u = gu[:F], gu[F:]
    silu = g / (1 + np.exp(-g))
    want = silu * u
    bound = 1.1 * err[:F] * np.abs(u) + np.abs(silu) * err[F:] + err[:F] * err[F:] + 8 * 2.0 ** -24 * np.abs(want)
    return want, bound + 1e-7


@interpreter
@pytest.mark.parametrize("name, F, K", [("int8", 37, 200), ("int4:32", 37, 200), ("int4:64", 21, 200),
                                        ("q4_0", 37, 160), ("q8_0", 19, 96), ("q4_1", 37, 160)])
@pytest.mark.parametrize("block_n", [None, 4, "persistent"])
def test_gate_up_swiglu_is_dequantize_then_norm_matmul_swiglu(name, F, K, block_n):
    rec = record(name, 2 * F, K, seed=7)  # rows: F gate rows, then F up rows; F odd: a ragged last row block
    t = from_quantized_linear(rec, "cpu")
    rng = np.random.default_rng(8)
    x = (3 * rng.standard_normal(K)).astype(np.float32)
    nw = (1 + 0.1 * rng.standard_normal(K)).astype(np.float32)
    cfg = None if block_n is None else (block_n, 32 if t.bits == 4 else 16, 4, 1, 1)  # several K tiles
    if block_n == "persistent":  # 3 programs over the row blocks of 4 gate / 4 up rows, one tile a row
        cfg = (8, 256, 4, 1, 2, 3)
    got = launch(t, torch.from_numpy(x)[None], torch.from_numpy(nw), config=cfg)[0].numpy()
    want, bound = oracle_swiglu(rec.dequantize(), x, nw)
    assert got.shape == (F,)
    assert (np.abs(got - want) <= bound).all(), f"max excess {np.max(np.abs(got - want) - bound):.3g}"


@interpreter
@pytest.mark.parametrize("spec", ["int8", "int4:64"])
def test_quantized_norm_mlp_add_is_the_mlp_block(spec):
    """ops.norm_mlp_add with quantized weights (the SwiGLU in gate_up's epilogue) equals
    x + down(swiglu(gate_up(rms_norm(x)))) with the oracle's dequantized weights."""
    F, D = 38, 64  # F even: int4 packs two codes a byte along down's K = F
    gu_rec = record(spec, 2 * F, D, seed=9)
    down_rec = record(spec, D, F, seed=10)
    rng = np.random.default_rng(11)
    x = (3 * rng.standard_normal((1, D))).astype(np.float32)
    nw = (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)
    h = np_ops.rms_norm(x, nw, EPS)  # [1, D]
    gu = h @ gu_rec.dequantize().T  # [1, D] @ [D, 2F] -> [1, 2F]
    want = x + np_ops.swiglu(gu[:, :F], gu[:, F:]) @ down_rec.dequantize().T  # [1, F] @ [F, D] -> [1, D]
    resid = torch.from_numpy(x.copy())
    out = ops.norm_mlp_add(resid, torch.from_numpy(nw), from_quantized_linear(gu_rec, "cpu"),
                           from_quantized_linear(down_rec, "cpu"), EPS)
    assert out is resid
    np.testing.assert_allclose(resid.numpy(), want, rtol=1e-5, atol=1e-4)
    resid = torch.from_numpy(x.copy())  # accumulate=False: a tensor-parallel rank's partial sum overwrites x
    ops.norm_mlp_add(resid, torch.from_numpy(nw), from_quantized_linear(gu_rec, "cpu"),
                     from_quantized_linear(down_rec, "cpu"), EPS, accumulate=False)
    np.testing.assert_allclose(resid.numpy(), want - x, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("spec", ["int8", "int4:64"])
@pytest.mark.parametrize("accumulate", [True, False])
def test_quantized_gated_products_are_a_cross_layers(spec, accumulate):
    """linear_add / swiglu_linear_add with a gate (a Vision cross layer's tanh gate, as a quantized tensor-parallel
    shard runs them) on quantized weights: x + g·product, or (accumulate False: a rank's partial sum) g·product,
    with the oracle's dequantized weights."""
    F, D = 38, 64
    o_rec, down_rec = record(spec, D, F, seed=12), record(spec, D, F, seed=13)
    rng = np.random.default_rng(14)
    x, a = (3 * rng.standard_normal((1, D))).astype(np.float32), rng.standard_normal((1, F)).astype(np.float32)
    gu = (3 * rng.standard_normal((1, 2 * F))).astype(np.float32)
    g = np.tanh(np.array([-0.6], np.float32))
    kept = x if accumulate else 0
    resid = torch.from_numpy(x.copy())
    ops.linear_add(torch.from_numpy(a), from_quantized_linear(o_rec, "cpu"), resid, gate=torch.from_numpy(g),
                   accumulate=accumulate)
    np.testing.assert_allclose(resid.numpy(), kept + g * (a @ o_rec.dequantize().T), rtol=1e-5, atol=1e-4)
    resid = torch.from_numpy(x.copy())
    ops.swiglu_linear_add(torch.from_numpy(gu), from_quantized_linear(down_rec, "cpu"), resid,
                          gate=torch.from_numpy(g), accumulate=accumulate)
    act = np_ops.swiglu(gu[:, :F], gu[:, F:])  # [1, F]
    np.testing.assert_allclose(resid.numpy(), kept + g * (act @ down_rec.dequantize().T), rtol=1e-5, atol=1e-4)


@gpu
@pytest.mark.parametrize("spec", ["int8", "int4:64", "int4:32"])
@pytest.mark.parametrize("F, D", [(8192, 2048), (8192, 3072)])
@pytest.mark.parametrize("config", [None, "persistent"])
def test_gate_up_swiglu_at_llama_shapes_gpu(spec, F, D, config):
    g = torch.Generator(device="cuda").manual_seed(0)
    t = quantize(torch.randn(2 * F, D, device="cuda", generator=g) * 0.02, QuantSpec.parse(spec))
    x = torch.randn(1, D, device="cuda", generator=g).to(torch.bfloat16)
    nw = (1 + 0.1 * torch.randn(D, device="cuda", generator=g)).to(torch.bfloat16)
    from accel.ops.torch_ops import torch_rms_norm, torch_swiglu_gate_up
    gu = (torch_rms_norm(x, nw, EPS).double() @ t.dequantize().double().T).to(torch.bfloat16)  # [1, 2F]
    want = torch_swiglu_gate_up(gu).double()  # the unfused path's roundings on fp64 sums
    if config == "persistent":  # 264 programs over the 512 or 1024 row blocks, one tile a row
        config = (16, 2048 if D == 2048 else 4096, 4, 1, 3, 264)
    got = launch(t, x, nw, config=config).double()
    # gate and up each one bf16 rounding away from fp64 sums (the GEMV's fp32 sums may round the other way)
    err = (got - want).abs().max().item()
    assert err <= 2 ** -6 * want.abs().max().item() + 1e-3, err
    down = quantize(torch.randn(D, F, device="cuda", generator=g) * 0.02, QuantSpec.parse(spec))
    resid = x.clone()
    block = ops.norm_mlp_add(resid, nw, t, down, EPS).double()  # the whole block: gate_up's SwiGLU, then down
    h = torch_swiglu_gate_up(gu)  # [1, F], the unfused path's rounding
    want_block = x.double() + (h.double() @ down.dequantize().double().T).to(torch.bfloat16).double()
    # h may sit one bf16 rounding from the fp64 path's (above), carried through down's sum, then the add's rounding
    assert (block - want_block).abs().max().item() <= 2 ** -6 * want_block.abs().max().item() + 1e-3
