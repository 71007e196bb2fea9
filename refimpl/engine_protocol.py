"""The engine contract: what the CLI commands and the debugging tools (tools/) ask of a backend's engine.

`refimpl.generate.RefEngine` (NumPy) and `accel.engine.AccelEngine` (torch + Triton) both satisfy `Engine`;
tests/test_op_contracts.py checks their signatures against it and runs both through it on a golden model.
Values an engine yields are its own arrays (NumPy or torch); `to_numpy` / `from_numpy` convert at the boundary,
so that tools compare and swap activations between backends without knowing either.
"""
from __future__ import annotations

from typing import Any, Iterable, Iterator, Protocol, runtime_checkable

import numpy as np

from refimpl.generate import Sampling
from refimpl.model.config import LlamaConfig
from refimpl.model.llama import KVCache

Value = Any  # np.ndarray (refimpl) or torch.Tensor (accel)


@runtime_checkable
class Engine(Protocol):
    backend: str  # "refimpl" or "accel": the name reports and CLI options use
    config: LlamaConfig

    def new_cache(self, capacity: int) -> KVCache:
        """An empty KV cache for `capacity` positions (GenerationError when it does not fit the model or memory)."""

    def steps(self, ids: Iterable[int], positions: Iterable[int], cache: KVCache,
              last_logits_only: bool = False) -> Iterator[tuple[str, Value]]:
        """Trace mode: the forward of `ids` at `positions` over `cache` (updated in place), op by op, yielding
        (activation name, value) in refimpl.model.names' order; a consumer may `send()` a replacement value back
        (lockstep debugging feeds one backend's outputs to the other). Logits last, [1, V] if last_logits_only."""

    def generate(self, prompt_ids: list[int], s: Sampling, stop_ids: Iterable[int] = ()) -> Iterator[int]:
        """New token ids after the prompt, one at a time, at most s.max_new_tokens, ending after a stop id."""

    def to_numpy(self, value: Value) -> np.ndarray:
        """A yielded value as float32 NumPy."""

    def from_numpy(self, array: np.ndarray, like: Value = None) -> Value:
        """A NumPy array as this engine's value (like `like`'s dtype and device when given)."""
