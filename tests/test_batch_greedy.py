"""The batch engine's greedy head (accel.ops.paged.greedy_rows: accel/kernels/argmax.py's argmax_rows_fwd under the
interpreter, and its torch version) against torch.argmax and torch.isfinite row by row: ties to the first index,
NaN the largest, rows of ±inf, a maximum in the last partial block, rows past one program."""
import pytest

torch = pytest.importorskip("torch")

from accel.kernels import argmax as argmax_kernels  # noqa: E402
from accel.kernels.argmax import argmax_rows_fwd  # noqa: E402
from accel.ops.dispatch import INTERPRET, torch_only  # noqa: E402
from accel.ops.paged import greedy_rows  # noqa: E402


def logits_rows(V: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, V, generator=g)
    x[1, 3], x[1, V - 5] = 40.0, 40.0  # a tie across programs: the first wins
    x[2, V // 2] = float("nan")  # NaN counts as the largest (torch.argmax) and the row is not finite
    x[3, V - 1] = float("inf")  # the maximum in the last, partial block
    x[4] = float("-inf")  # every logit -inf: index 0, not finite
    x[5, 0] = 1e30  # large but finite
    x[6, 10:] = -1e4
    return x.to(dtype)


def want(x: torch.Tensor) -> torch.Tensor:
    return torch.stack([torch.argmax(x, dim=-1), torch.isfinite(x).all(dim=-1).to(torch.int64)])


@pytest.mark.skipif(not INTERPRET, reason="the kernel on CPU tensors needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("V,block", [(1000, 128), (4096, 4096), (5000, 1024)])
def test_argmax_rows_kernel_matches_torch(V, block, monkeypatch):
    monkeypatch.setattr(argmax_kernels, "ROWS_BLOCK", block)
    x = logits_rows(V)
    out = torch.full((2, x.shape[0]), -7, dtype=torch.int64)
    for _ in range(2):  # the rows' arrival counts are back at zero for the second launch
        assert torch.equal(argmax_rows_fwd(x, out), want(x))
    assert torch.equal(argmax_rows_fwd(x[::2]), want(x[::2]))  # rows strided, fewer of them


def test_greedy_rows_torch_version_matches_torch():
    x = logits_rows(1000)
    with torch_only():
        assert torch.equal(greedy_rows(x), want(x))
        assert greedy_rows(x[:0]).shape == (2, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_gpu(dtype):
    x = logits_rows(128256, dtype).cuda()
    for _ in range(2):
        assert torch.equal(argmax_rows_fwd(x).cpu(), want(x.cpu()))
    big = torch.randn(256, 128256, device="cuda", dtype=dtype)
    assert torch.equal(argmax_rows_fwd(big), want(big))
