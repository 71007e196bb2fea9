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
    hashable `extra`) for the last `keep` tuples. Entries hold only weak references to the tensors themselves, and
    an entry goes when one of its tensors does: a model makes its masks and RoPE tables anew every forward, so what
    was derived from the last step's dies with them instead of waiting to be evicted (a Llama 3.2 Vision step's
    masks: 50 MB)."""

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
        if ids not in self._memo and len(self._memo) >= self.keep:
            self._memo.pop(next(iter(self._memo)))
        refs = tuple(weakref.ref(t, lambda ref, ids=ids: self._forget(ids, ref)) for t in tensors)
        self._memo[ids] = (refs, key, value)
        return value

    def __len__(self) -> int:
        return len(self._memo)

    def _forget(self, ids: tuple, ref) -> None:
        """A tensor of `ids` died: drop its entry (only if the entry is still the one that referenced it)."""
        hit = self._memo.get(ids)
        if hit is not None and any(r is ref for r in hit[0]):
            del self._memo[ids]
