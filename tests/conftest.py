"""Test-wide setup.

Without CUDA, accel's Triton kernels run under Triton's interpreter on CPU tensors; the variable must be set before
triton is first imported, so it is set here, at collection time, for the whole session.
"""
import os

# As tools/cli/__init__.py: threaded OpenBLAS gemv collapses when cores are shared (pytest -n 2 on 2 cores): SmolLM2
# decode of 32 tokens took 23-33 s with 2 threads under load, 1.3 s with 1. Must precede NumPy's first import (torch's).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

try:
    import torch
    _cuda = torch.cuda.is_available()
except ImportError:  # refimpl tests still run without torch
    _cuda = False
if not _cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")
