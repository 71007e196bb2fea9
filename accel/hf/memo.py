"""What a model derives once from tensors it passes unchanged to every layer (the attention mask, the RoPE cos/sin
tables): computed at the first layer, looked up at the others and in the gradient-checkpointing recompute."""
from __future__ import annotations

import weakref

import torch


def version(t: torch.Tensor) -> int:
    """t's version counter (bumped by every in-place change); -1 for inference tensors, which keep none (they
    cannot be changed outside inference mode)."""
    return -1 if t.is_inference() else t._version


class PerTensor:
    """Values derived from tensors, remembered per tuple of tensors (their identities and versions, and the caller's
    hashable `extra`) for the last `keep` tuples. Entries hold only weak references to the tensors themselves."""

    def __init__(self, keep: int = 8):
        self.keep = keep
        self._memo: dict[tuple, tuple] = {}  # ids -> (weakrefs, (versions, extra), value)

    def get(self, tensors: tuple, extra, derive):
        """derive() once per (tensors, their versions, extra); the remembered value after that."""
        ids = tuple(id(t) for t in tensors)
        key = (tuple(version(t) for t in tensors), extra)
        hit = self._memo.get(ids)
        if hit is not None and all(r() is t for r, t in zip(hit[0], tensors)) and hit[1] == key:
            return hit[2]
        value = derive()
        if len(self._memo) >= self.keep:
            self._memo.pop(next(iter(self._memo)))
        self._memo[ids] = (tuple(weakref.ref(t) for t in tensors), key, value)
        return value
