"""Test-wide setup.

Without CUDA, accel's Triton kernels run under Triton's interpreter on CPU tensors; the variable must be set before
triton is first imported, so it is set here, at collection time, for the whole run.

Also here: the `gpu` marker on every CUDA-only test (`pytest -m gpu` selects the GPU suite); GPU memory given back
after each test and each xdist worker's share of the card capped; the default model for the real-model tests, whose
absence fails CI instead of skipping.
"""
import gc
import os
import re

import pytest

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


@pytest.fixture
def torch_one_thread():
    """torch on one CPU thread during the test: the CI machine's cores are shared, and oversubscribed threads are
    10x slower there. (A module takes it with `pytestmark = pytest.mark.usefixtures("torch_one_thread")`.)"""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---- the gpu marker ----

_NEEDS_CUDA = re.compile(r"^needs (a )?CUDA")  # every CUDA-only skipif's reason: "needs CUDA", "needs a CUDA GPU"


def needs_cuda(item) -> bool:
    """A test that runs only with CUDA: it lives in a *_gpu.py file, or a skipif says it needs CUDA. (A test that
    skips itself in its body for lack of CUDA carries an explicit @pytest.mark.gpu.)"""
    return item.path.name.endswith("_gpu.py") or any(
        _NEEDS_CUDA.match(str(m.kwargs.get("reason", ""))) for m in item.iter_markers("skipif"))


def pytest_collection_modifyitems(config, items):
    for item in items:
        if needs_cuda(item):
            item.add_marker(pytest.mark.gpu)


# ---- GPU memory under pytest-xdist ----

# Above the most one GPU test holds at once, as read from the code (not measured): trace mode's vision encoder
# attention at the real shape, fp32 scores of 16 heads over 4 · 1608 tokens (~8 GiB at its peak), beside the
# 4096-wide test model's weights. A worker is never capped below it.
GPU_TEST_PEAK_GIB = 12
CONTEXT_GIB = 1  # each process's CUDA context, cuBLAS workspace and Triton's modules: outside the allocator's cap


def worker_memory_fraction(workers: int, total_gib: float) -> float:
    """Each of `workers` processes' share of a card of `total_gib`, after their contexts, as a fraction of the card;
    never below one test's peak (too many workers for the card then fail on memory as they would without a cap)."""
    share = (total_gib - workers * CONTEXT_GIB) / workers
    return min(1.0, max(share, GPU_TEST_PEAK_GIB) / total_gib)


if _cuda and os.environ.get("PYTEST_XDIST_WORKER"):
    # With a cap, the caching allocator frees its cached blocks and retries before it reports out of memory, so a
    # worker that once ran a large test does not keep that memory from the others. Workers only: the controller
    # runs no test and should not hold a CUDA context.
    _total = torch.cuda.get_device_properties(0).total_memory / 2 ** 30
    torch.cuda.set_per_process_memory_fraction(
        worker_memory_fraction(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")), _total))


@pytest.fixture(autouse=True)
def _give_back_gpu_memory():
    """After each test that touched CUDA: collect the test's cycles (engines, graphs) and return the allocator's
    cached blocks to the driver, so that the other workers on the card can have them."""
    yield
    if _cuda and torch.cuda.is_initialized() and torch.cuda.memory_reserved():
        gc.collect()
        torch.cuda.empty_cache()


# ---- the default model (real-model tests) ----

def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def unavailable(reason: str):
    """Skip a test whose input cannot be had here, but fail it in CI (CI=true), where .ci/run provides it: a test
    that checks a real model must not vanish quietly behind a green run."""
    if in_ci():
        pytest.fail(f"{reason} (CI is set: a real-model test must run, not skip)", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def default_model():
    """The default model's GGUF (SmolLM2-135M-Instruct, tools.default_model), downloaded if it is not cached."""
    from refimpl.errors import Llama32Error
    from tools.default_model import default_model_path
    try:
        return default_model_path(fetch_if_missing=True)
    except Llama32Error as e:
        unavailable(f"the default model could not be fetched: {e}")
