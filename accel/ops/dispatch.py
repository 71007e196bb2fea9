"""Where an op runs, decided per call from its input tensor.

  * CUDA tensors run the Triton kernels of `accel.kernels`;
  * CPU tensors run the same kernels under Triton's interpreter when TRITON_INTERPRET=1 (tests/conftest.py sets it
    on machines without CUDA, so CI exercises the kernels' indexing and masking on CPU);
  * otherwise, and inside `torch_only()`, the op's plain torch version (`torch_*`, beside each op): the same math in
    the same dtype order, so an engine runs on a CPU-only machine without the (slow) interpreter, and a CUDA engine
    can be run without Triton as a baseline.
The variable is read once, at import: triton decides at `@triton.jit` time (also import time) whether a kernel is
interpreted, so reading it later could route CPU tensors to kernels that cannot run on them.
"""
from __future__ import annotations

import contextlib
import contextvars
import os

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_TORCH_ONLY = contextvars.ContextVar("accel_ops_torch_only", default=False)


def uses_triton(x: torch.Tensor) -> bool:
    """True where an op runs a Triton kernel for x: on CUDA, and on CPU under the interpreter."""
    return (x.is_cuda or (INTERPRET and x.device.type == "cpu")) and not _TORCH_ONLY.get()


def triton_available(device: torch.device) -> bool:
    """Whether tensors on `device` can reach the Triton kernels at all."""
    return device.type == "cuda" or (INTERPRET and device.type == "cpu")


@contextlib.contextmanager
def torch_only(on: bool = True):
    """Within this block (this thread), every op runs its torch version, whatever the device."""
    token = _TORCH_ONLY.set(on)
    try:
        yield
    finally:
        _TORCH_ONLY.reset(token)


def rows(x: torch.Tensor) -> torch.Tensor:
    """Kernels index with strides but need unit stride along the last dimension."""
    return x if x.stride(-1) == 1 else x.contiguous()
