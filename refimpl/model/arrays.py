"""The few array manipulations the Mllama forward needs besides the ops, for NumPy arrays and for any array type
with torch's method names (accel's trace mode runs the same forward over torch tensors).

They move values around without computing anything an op would own, so they are not ops. refimpl stays
torch-free by duck typing: a NumPy array takes the NumPy branch, anything else its own methods. Concatenation
and stacking are written as slice assignments into `zeros(...)`, which both array types support.
"""
from __future__ import annotations

import numpy as np


def _is_numpy(x) -> bool:
    return isinstance(x, (np.ndarray, np.generic))


def tanh(x):
    return np.tanh(x) if _is_numpy(x) else x.tanh()


def permute(x, axes: tuple[int, ...]):
    return x.transpose(axes) if _is_numpy(x) else x.permute(*axes)


def zeros(like, shape: tuple[int, ...]):
    """Zeros of `shape` with like's dtype (and device)."""
    return np.zeros(shape, like.dtype) if _is_numpy(like) else like.new_zeros(shape)


def scale_rows(x, keep):
    """x [T, ...] with the rows where the host bool array keep [T] is False set to zero (x · keep)."""
    if _is_numpy(x):
        return x * keep.reshape(-1, *[1] * (x.ndim - 1)).astype(x.dtype)
    return x * x.new_tensor(np.asarray(keep, np.float32)).reshape(-1, *[1] * (x.ndim - 1))
