"""Host -> device copies that do not wait for the device.

With overlap (engine.py) a step is built and launched while the previous one still runs. A plain copy from pageable
host memory (`torch.tensor(..., device="cuda")`, `.to("cuda")`) synchronizes with the stream first, which would
stall the host until the device is idle; a copy from pinned memory with `non_blocking=True` is queued on the stream
instead (PyTorch's pinned-memory cache keeps the buffer until the copy is done).
"""
from __future__ import annotations

import numpy as np
import torch


def host_tensor(values, dtype: torch.dtype | None = None, pin: bool = False) -> torch.Tensor:
    """A host list, NumPy array (which keeps its dtype) or CPU tensor as a CPU tensor; pinned with `pin`."""
    if isinstance(values, np.ndarray):
        t = torch.from_numpy(np.ascontiguousarray(values))
    else:
        t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    return t.pin_memory() if pin else t


def to_device(values, dtype: torch.dtype | None, device) -> torch.Tensor:
    """host_tensor's tensor on the device, its copy queued behind the device's work (on CUDA)."""
    cuda = torch.device(device).type == "cuda"
    t = host_tensor(values, dtype, pin=cuda)
    return t.to(device, non_blocking=True) if cuda else t
