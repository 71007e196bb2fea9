"""Shared pieces of the training tests (test_train_kernels.py, test_train_layers.py): seeded inputs, float64
comparisons, RoPE tables at far positions, the skip markers."""
import os

import numpy as np
import pytest
import torch

from refimpl.model import ops as R
from refimpl.model.config import RopeScaling


interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="CPU-interpreter coverage; the GPU's is below")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
FP32 = dict(atol=1e-5, rtol=1e-5)  # fp32 kernels vs float64 NumPy: summation order and FMAs only


def randn(*shape, seed=0, dtype=torch.float32, device="cpu", scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(device=device, dtype=dtype)


def np64(x):
    return x.detach().double().cpu().numpy()


def close(got, want, what, **tol):
    torch.testing.assert_close(got.detach().double().cpu(), torch.as_tensor(want, dtype=torch.float64),
                               msg=lambda m: f"{what}: {m}", **(tol or FP32))


def tables(T, E, device="cpu"):
    cos, sin = R.rope_tables(np.arange(T) * 997, E, 500000.0, RopeScaling())  # far positions: every band turns
    return torch.from_numpy(cos).to(device), torch.from_numpy(sin).to(device)


BF16 = dict(atol=2e-2, rtol=2e-2)  # a few bf16 roundings apart (2^-9 each), see refimpl/compare.py


def rel_l2(got, want):
    return float((got.float() - want.float()).norm() / want.float().norm())
