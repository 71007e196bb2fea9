"""Test-wide setup.

Without CUDA, accel's Triton kernels run under Triton's interpreter on CPU tensors; the variable must be set before
triton is first imported, so it is set here, at collection time, for the whole session.
"""
import os

try:
    import torch
    _cuda = torch.cuda.is_available()
except ImportError:  # refimpl tests still run without torch
    _cuda = False
if not _cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")
