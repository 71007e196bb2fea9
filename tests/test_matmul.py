"""The weight-streaming GEMM (accel/kernels/matmul.py) against float64 products: fp32 under the Triton interpreter
(odd shapes, row counts off the 16-row MMA tile, uneven split-K), bf16 on the GPU at the Llama 3.2 shapes with every
config the sweep tries; and the batched engine's dispatch (accel.ops.paged.batched_linear) by the MATMUL table.
bf16 stays off the interpreter: its tl.dot of bf16 operands returns garbage on CPU (the products of raw bit
patterns), so bf16 numerics are checked where they run."""
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

from accel import ops  # noqa: E402
from accel.kernels.matmul import matmul_fwd, row_bucket  # noqa: E402
from accel.kernels.tuning import MATMUL, MatmulConfig  # noqa: E402
from accel.ops.paged import batched_linear  # noqa: E402

interpreter = pytest.mark.skipif(not ops.triton_available(torch.device("cpu")), reason="needs TRITON_INTERPRET=1")


def case(M, N, K, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator(device).manual_seed(seed)
    x = torch.randn(M, K, generator=g, device=device).to(dtype)
    w = (torch.randn(N, K, generator=g, device=device) * K ** -0.5).to(dtype)
    return x, w, x.double() @ w.double().T  # [M, K] @ [K, N] -> [M, N]


@interpreter
@pytest.mark.parametrize("M,N,K,cfg", [
    (1, 45, 70, MatmulConfig(16, 32, 16, 1, 4, 2)),  # one row, K off the tile
    (3, 33, 96, MatmulConfig(32, 32, 16, 3, 4, 1)),  # 3 tiles of K in 3 slices
    (17, 45, 70, MatmulConfig(16, 32, 16, 2, 4, 2)),  # 17 rows: two m blocks, the second of one row
    (37, 64, 128, MatmulConfig(32, 32, 32, 3, 4, 2)),  # 4 tiles of K in 2 slices (3 asked: one would be empty)
    (20, 16, 64, MatmulConfig(16, 64, 32, 1, 4, 1)),  # one tile of everything
])
def test_fp32_matches_float64(M, N, K, cfg):
    x, w, want = case(M, N, K)
    got = matmul_fwd(x, w, cfg)
    assert got.shape == (M, N) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@interpreter
def test_split_k_repeats_bitwise_and_rearms_its_counters():
    """The last program of a tile to arrive sums the slices in slice order and returns its counter to 0: the same
    bits on every call, other shapes between them included."""
    x, w, _ = case(19, 40, 160)
    cfg = MatmulConfig(16, 32, 16, 4, 4, 2)
    first = matmul_fwd(x, w, cfg)
    matmul_fwd(*case(5, 24, 96, seed=1)[:2], MatmulConfig(16, 32, 16, 3, 4, 1))
    assert torch.equal(matmul_fwd(x, w, cfg), first)


def rms_normed(x, g, eps):
    """HF's RMSNorm in float64: x · rsqrt(mean(x²) + eps) · g."""
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * g.double()


@interpreter
@pytest.mark.parametrize("M,N,K,cfg", [
    (1, 45, 70, MatmulConfig(16, 32, 16, 1, 4, 2)),  # one row, K off the tile (the norm's masked columns)
    (17, 40, 96, MatmulConfig(16, 32, 32, 1, 4, 1)),  # two m blocks, the second of one row
])
def test_fp32_norm_inside_matches_the_normed_product(M, N, K, cfg):
    """norm=(g, eps): rms_norm(x, g) @ wᵀ with the norm's sums and scales inside the kernel (rows of very
    different scales: each row's own 1 / rms)."""
    x, w, _ = case(M, N, K)
    x = x * torch.logspace(-2, 2, M)[:, None]
    g = 1 + 0.3 * torch.randn(K, generator=torch.Generator().manual_seed(3))
    want = rms_normed(x, g, 1e-5) @ w.double().T  # [M, K] @ [K, N]
    torch.testing.assert_close(matmul_fwd(x, w, cfg, norm=(g, 1e-5)).double(), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(AssertionError, match="whole rows"):
        matmul_fwd(x, w, MatmulConfig(16, 32, 16, 2, 4, 1), norm=(g, 1e-5))


@interpreter
@pytest.mark.parametrize("cfg", [MatmulConfig(16, 32, 16, 1, 4, 2), MatmulConfig(16, 32, 16, 3, 4, 1)])
def test_fp32_residual_is_added_over_it(cfg):
    """residual=r: r + x @ wᵀ written over r (also when the last program of a split-K tile stores it)."""
    x, w, prod = case(19, 40, 96)
    r = torch.randn(19, 40, generator=torch.Generator().manual_seed(4))
    want = r.double() + prod
    got = matmul_fwd(x, w, cfg, residual=r)
    assert got.data_ptr() == r.data_ptr()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@interpreter
def test_batched_linear_norm_and_residual_outside_the_kernel():
    """Where the table has no config (or only a split-K one, for a normed input): rms_norm, then cuBLAS / torch,
    the residual added over it; the same values as the kernel's within fp32 rounding."""
    x, w, _ = case(6, 40, 64)
    g = 1 + 0.3 * torch.randn(64, generator=torch.Generator().manual_seed(5))
    want = rms_normed(x, g, 1e-5) @ w.double().T
    split = {(40, 64, 8): MatmulConfig(16, 32, 16, 2, 4, 1)}
    for table in ({}, split, {(40, 64, 8): MatmulConfig(16, 32, 16, 1, 4, 1)}):
        torch.testing.assert_close(batched_linear(x, w, table, norm=(g, 1e-5)).double(), want, rtol=1e-5, atol=1e-5)
        r = torch.ones(6, 40)
        got = batched_linear(x, w, table, residual=r)
        assert got.data_ptr() == r.data_ptr()
        torch.testing.assert_close(got.double(), 1 + x.double() @ w.double().T, rtol=1e-5, atol=1e-5)


def test_row_buckets_are_the_decode_graphs_buckets():
    from accel.batch.graphs import BUCKETS
    assert [row_bucket(b) for b in BUCKETS] == list(BUCKETS)
    assert [row_bucket(m) for m in (3, 5, 33, 65, 200)] == [4, 8, 64, 128, 256]


@interpreter
def test_batched_linear_takes_the_kernel_where_the_table_lists_the_bucket(monkeypatch):
    """(N, K, bucket) in the table: the kernel with that row's config; else (or outside Triton) F.linear."""
    x, w, want = case(6, 40, 64)
    cfg = MatmulConfig(16, 32, 16, 2, 4, 1)
    used = []
    monkeypatch.setattr("accel.ops.paged.matmul_fwd", lambda a, b, c, *more: used.append(c) or matmul_fwd(a, b, c, *more))
    torch.testing.assert_close(batched_linear(x, w, {(40, 64, 8): cfg}).double(), want, rtol=1e-5, atol=1e-5)
    assert used == [cfg]
    for table in ({(40, 64, 4): cfg}, {}):
        assert torch.equal(batched_linear(x, w, table), F.linear(x, w))
    with ops.torch_only():
        assert torch.equal(batched_linear(x, w, {(40, 64, 8): cfg}), F.linear(x, w))
    assert used == [cfg]


def test_matmul_table_rows_are_valid_configs():
    for (N, K, M), cfg in MATMUL.items():
        assert isinstance(cfg, MatmulConfig) and row_bucket(M) == M and K % cfg.block_k == 0
        assert cfg.block_m >= 16 and cfg.block_n >= 16 and cfg.split_k >= 1 and cfg.stages >= 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("M", [5, 64])
def test_bf16_gpu_every_candidate_config(M):
    """bf16 in, fp32 accumulation, bf16 out: within the output's rounding of the float64 product (the 1B o and down
    shapes, every candidate of the sweep and every table row of the shape)."""
    from accel.kernels.common import sm_count
    from tools.bench.sweeps.skinny import candidates
    for N, K in ((2048, 2048), (2048, 8192)):
        x, w, want = case(M, N, K, torch.bfloat16, "cuda")
        cublas = (F.linear(x, w).double() - want).abs().max().item()
        configs = candidates(N, K, M, sm_count(x.device)) + [c for k, c in MATMUL.items() if k[:2] == (N, K)]
        for cfg in configs:
            got = matmul_fwd(x, w, cfg).double()
            err = (got - want).abs().max().item()
            assert err <= 2 * cublas + 1e-6, (cfg, err, cublas)
            torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_gpu_batched_linear_at_every_table_row():
    """Each MATMUL row through the batched engine's dispatch, at its bucket's row count and at one past the bucket
    below (the rows an eager step may bring): within the output's rounding of the float64 product, and no worse than
    twice cuBLAS's error."""
    for (N, K, M), cfg in MATMUL.items():
        for rows in sorted({M, M // 2 + 1}):
            x, w, want = case(rows, N, K, torch.bfloat16, "cuda", seed=M)
            assert row_bucket(rows) == M
            got = batched_linear(x, w).double()
            err = (got - want).abs().max().item()
            assert err <= 2 * (F.linear(x, w).double() - want).abs().max().item() + 1e-6, ((N, K, M), cfg, err)
            torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_gpu_norm_and_residual_inside_at_the_1b_shapes():
    """bf16 at the 1B decode shapes through the batched engine's dispatch: the final norm inside the lm_head kernel
    (64 rows), the residual over the down GEMM's output (16 rows: the kernel with split-K; 64 rows: cuBLAS's beta =
    1), each within the output's rounding of the float64 result and no worse than twice the unfused path's error
    (the norm kernel, then the GEMM; the GEMM, then an add)."""
    gen = torch.Generator("cuda").manual_seed(0)
    for N, K, M, norm in ((128256, 2048, 64, True), (2048, 8192, 16, False), (2048, 8192, 64, False)):
        x, w, prod = case(M, N, K, torch.bfloat16, "cuda", seed=M)
        if norm:
            g = (1 + 0.3 * torch.randn(K, generator=gen, device="cuda")).to(torch.bfloat16)
            want = rms_normed(x, g, 1e-5) @ w.double().T
            got = batched_linear(x, w, norm=(g, 1e-5)).double()
            unfused = batched_linear(ops.rms_norm(x, g, 1e-5), w).double()
        else:
            r = torch.randn(M, N, generator=gen, device="cuda").to(torch.bfloat16)
            want = r.double() + prod
            unfused = (r + batched_linear(x, w)).double()
            got = batched_linear(x, w, residual=r.clone()).double()
        err, base = (got - want).abs().max().item(), (unfused - want).abs().max().item()
        assert err <= 2 * base + 1e-6, ((N, K, M), err, base)
        torch.testing.assert_close(got, want, rtol=1.6e-2, atol=2e-2)
