"""The logic of `llama32 diff`: two engines on the same tokens in lockstep, a comparison row per activation.

Engine a is the reference. Both see the same tokens: the prompt, then greedy decode steps chosen from a's logits
(so a divergence in b cannot change what the two are asked to compute).
"""
from __future__ import annotations

import numpy as np

from refimpl.compare import TOLERANCES

from tools.debug.lockstep import compare_rows, engine_dtype, reference_stream


def diff_engines(a, b, prompt_ids: list[int], decode_steps: int, dtype: str | None = None, keep=lambda key: True,
                 isolate: bool = False, dump: dict | None = None):
    """Prefill + decode steps on both engines in lockstep. Returns (rows, dtype); fills `dump` if given.
    dtype None: bf16 tolerance if either engine computes in bf16, else fp32."""
    dtype = dtype or ("bf16" if "bf16" in (engine_dtype(a), engine_dtype(b)) else "fp32")
    capacity = len(prompt_ids) + decode_steps
    cache_a, cache_b = a.new_cache(capacity), b.new_cache(capacity)
    ids, positions, rows, last = list(prompt_ids), list(range(len(prompt_ids))), [], {}

    def sink(step, name, ref, got):
        if name == "logits":
            last["logits"] = ref
        if dump is not None:
            dump[f"a/{step}/{name}"], dump[f"b/{step}/{name}"] = np.array(ref, np.float32), np.array(got, np.float32)

    for k in range(decode_steps + 1):
        step = "prefill" if k == 0 else f"decode{k - 1}"
        reference = reference_stream(a, a.steps(ids, positions, cache_a))
        rows += compare_rows(reference, b, b.steps(ids, positions, cache_b), TOLERANCES[dtype], keep, isolate, step,
                             sink)
        ids, positions = [int(np.argmax(last["logits"][-1]))], [positions[-1] + 1]
    return rows, dtype
