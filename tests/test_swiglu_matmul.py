"""The gate_up GEMM with SwiGLU in its epilogue (accel/kernels/matmul.py swiglu_matmul_fwd) against the GEMM then
the SwiGLU kernel with the same config — bit for bit on the GPU (bf16, real shapes); on CPU within fp32 rounding, as
the interpreter's tl.dot is NumPy's matmul, whose bits follow the CPU's BLAS kernel and each operand's layout — and
against a float64 product with HF's roundings; the batched engine's dispatch (accel.ops.paged.batched_swiglu_linear) by the SWIGLU_MATMUL table.
fp32 under the Triton interpreter, bf16 on the GPU: on CPU the interpreter's tl.dot of bf16 operands returns garbage
(tests/test_matmul.py) and its fp32 -> bf16 casts truncate where the GPU rounds to nearest, so no bf16 bit there
says anything about the GPU's."""
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

from accel import ops  # noqa: E402
from accel.kernels.matmul import (INVARIANT, invariant_matmul_fwd, invariant_swiglu_matmul_fwd,  # noqa: E402
                                  matmul_fwd, row_bucket, swiglu_matmul_fwd)
from accel.kernels.swiglu import swiglu_gate_up_fwd  # noqa: E402
from accel.kernels.tuning import MATMUL, SWIGLU_MATMUL, MatmulConfig  # noqa: E402
from accel.ops.paged import batched_swiglu_linear  # noqa: E402

interpreter = pytest.mark.skipif(not ops.triton_available(torch.device("cpu")), reason="needs TRITON_INTERPRET=1")
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def case(M, F_, K, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator(device).manual_seed(seed)
    x = torch.randn(M, K, generator=g, device=device).to(dtype)
    w = (torch.randn(2 * F_, K, generator=g, device=device) * K ** -0.5).to(dtype)  # [gate; up] rows
    return x, w


def hf_swiglu(x, w):
    """HF's LlamaMLP order from a float64 product: gate and up rounded to the dtype, silu rounded, product rounded."""
    F_ = w.shape[0] // 2
    gu = (x.double() @ w.double().T).to(x.dtype)  # [M, K] @ [K, 2F] -> [M, 2F]
    g, u = gu[:, :F_], gu[:, F_:]
    return (F.silu(g.float()).to(x.dtype).float() * u.float()).to(x.dtype)


@interpreter
@pytest.mark.parametrize("M,F_,K,cfg", [
    (1, 24, 64, MatmulConfig(16, 32, 16, 1, 4, 2)),  # one row, F off the tile
    (3, 40, 96, MatmulConfig(16, 32, 16, 3, 4, 1)),  # 3 K slices
    (16, 32, 70, MatmulConfig(16, 32, 16, 2, 4, 2)),  # K off the tile, 2 slices
    (64, 48, 64, MatmulConfig(32, 32, 32, 1, 4, 1)),  # two m blocks, two n blocks (the second half empty)
    (64, 40, 128, MatmulConfig(16, 32, 32, 4, 4, 2)),  # two m blocks, 4 slices
])
def test_fp32_is_the_gemm_then_swiglu(M, F_, K, cfg):
    x, w = case(M, F_, K)
    got = swiglu_matmul_fwd(x, w, cfg)
    assert got.shape == (M, F_) and got.dtype == torch.float32
    torch.testing.assert_close(got, swiglu_gate_up_fwd(matmul_fwd(x, w, cfg)), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got, hf_swiglu(x, w), rtol=1e-5, atol=1e-5)


@interpreter
def test_split_k_repeats_bitwise_between_other_launches():
    """Both halves' partials summed by the last program, its counter returned to 0: the same bits on every call,
    other split launches (the plain GEMM's too) between them."""
    x, w = case(19, 40, 160)
    cfg = MatmulConfig(16, 32, 16, 4, 4, 2)
    first = swiglu_matmul_fwd(x, w, cfg)
    matmul_fwd(*case(5, 12, 96, seed=1), MatmulConfig(16, 32, 16, 3, 4, 1))
    swiglu_matmul_fwd(*case(7, 24, 64, seed=2), MatmulConfig(16, 16, 16, 4, 4, 1))
    assert torch.equal(swiglu_matmul_fwd(x, w, cfg), first)


@interpreter
def test_invariant_rows_are_their_bits_alone():
    """The invariant mode's fused gate_up: each row's bits the same alone as in a batch; the unfused pair's values."""
    x, w = case(9, 40, 64)
    both = invariant_swiglu_matmul_fwd(x, w)
    torch.testing.assert_close(both, swiglu_gate_up_fwd(invariant_matmul_fwd(x, w)), rtol=1e-6, atol=1e-6)
    for t in (0, 4, 8):
        assert torch.equal(invariant_swiglu_matmul_fwd(x[t:t + 1], w), both[t:t + 1])


@interpreter
def test_dispatch_takes_the_fused_kernel_where_the_table_lists_the_bucket(monkeypatch):
    """(2F, K, bucket) in the table: the fused kernel with that config; else the GEMM (MATMUL's or F.linear) then
    SwiGLU; outside Triton, torch's."""
    x, w = case(6, 20, 64)
    cfg = MatmulConfig(16, 32, 16, 2, 4, 1)
    used = []
    monkeypatch.setattr("accel.ops.paged.swiglu_matmul_fwd",
                        lambda a, b, c: used.append(c) or swiglu_matmul_fwd(a, b, c))
    assert torch.equal(batched_swiglu_linear(x, w, {(40, 64, 8): cfg}), swiglu_matmul_fwd(x, w, cfg))
    assert used == [cfg]
    assert torch.equal(batched_swiglu_linear(x, w, {}, {}), swiglu_gate_up_fwd(F.linear(x, w)))
    assert torch.equal(batched_swiglu_linear(x, w, {(40, 64, 4): cfg}, {(40, 64, 8): cfg}),
                       swiglu_gate_up_fwd(matmul_fwd(x, w, cfg)))
    with ops.torch_only():
        torch.testing.assert_close(batched_swiglu_linear(x, w, {(40, 64, 8): cfg}), hf_swiglu(x, w),
                                   rtol=1e-5, atol=1e-5)
    assert used == [cfg]


def test_swiglu_table_rows_are_valid_configs():
    for (N, K, M), cfg in SWIGLU_MATMUL.items():
        assert isinstance(cfg, MatmulConfig) and row_bucket(M) == M and K % cfg.block_k == 0 and N % 2 == 0
        assert cfg.block_m >= 16 and cfg.block_n >= 16 and cfg.split_k >= 1 and cfg.stages >= 1


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("M", [3, 64])
def test_bf16_gpu_is_the_gemm_then_swiglu_bitwise(M):
    """bf16 at the 1B and 3B gate_up shapes: bit for bit the same config's GEMM then the SwiGLU kernel (the table's
    rows, MATMUL's, the invariant tiles, split-K or not), and within bf16 rounding of HF's order from float64."""
    for F_, K in ((8192, 2048), (8192, 3072)):
        x, w = case(M, F_, K, torch.bfloat16, "cuda", seed=M)
        want = hf_swiglu(x, w).float()
        configs = [MatmulConfig(64, 128, 16, 1, 4, 4), MatmulConfig(64, 64, 64, 4, 4, 3), INVARIANT]
        configs += [c for k, c in SWIGLU_MATMUL.items() if k[:2] == (2 * F_, K)]
        configs += [c._replace(block_n=c.block_n // 2) for k, c in MATMUL.items() if k[:2] == (2 * F_, K)]
        for cfg in dict.fromkeys(configs):
            got = swiglu_matmul_fwd(x, w, cfg)
            assert torch.equal(got, swiglu_gate_up_fwd(matmul_fwd(x, w, cfg))), cfg
            torch.testing.assert_close(got.float(), want, rtol=1.6e-2, atol=1e-2)
        assert torch.equal(batched_swiglu_linear(x, w), batched_swiglu_linear(x, w))
        torch.testing.assert_close(batched_swiglu_linear(x, w).float(), want, rtol=1.6e-2, atol=1e-2)
