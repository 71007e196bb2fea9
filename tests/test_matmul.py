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
    monkeypatch.setattr("accel.ops.paged.matmul_fwd", lambda a, b, c: used.append(c) or matmul_fwd(a, b, c))
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
