"""The one activation-name scheme: used by both backends, the golden files, the CLI filters and the reports.

Order is the order of computation in a forward; `tests/test_names.py` pins it exactly.

    embed                         [T, D]     token embeddings
    layers.{i}.attn_norm          [T, D]     RMSNorm before attention
    layers.{i}.attn.q             [T, H, E]  q_proj output, split into heads
    layers.{i}.attn.k             [T, K, E]
    layers.{i}.attn.v             [T, K, E]
    layers.{i}.attn.q_rot         [T, H, E]  after RoPE
    layers.{i}.attn.k_rot         [T, K, E]
    layers.{i}.attn.out           [T, H, E]  softmax(q kᵀ) v, before o_proj
    layers.{i}.attn.o_proj        [T, D]
    layers.{i}.resid_mid          [T, D]     residual after attention
    layers.{i}.mlp_norm           [T, D]
    layers.{i}.mlp.gate           [T, F]
    layers.{i}.mlp.up             [T, F]
    layers.{i}.mlp.act            [T, F]     silu(gate) · up
    layers.{i}.mlp.down           [T, D]
    layers.{i}.resid_post         [T, D]     residual after the MLP: the layer's output
    final_norm                    [T, D]
    logits                        [T, V]     (only the last row during generation prefill)

CLI filters are shell-style globs over these names (`layers.7.attn.*`, `*.mlp.act`).
"""
from __future__ import annotations

import fnmatch
import re

LAYER_ACTIVATIONS: tuple[str, ...] = (
    "attn_norm", "attn.q", "attn.k", "attn.v", "attn.q_rot", "attn.k_rot", "attn.out", "attn.o_proj",
    "resid_mid", "mlp_norm", "mlp.gate", "mlp.up", "mlp.act", "mlp.down", "resid_post",
)


def activation_names(num_layers: int) -> list[str]:
    names = ["embed"]
    for i in range(num_layers):
        names += [f"layers.{i}.{a}" for a in LAYER_ACTIVATIONS]
    return names + ["final_norm", "logits"]


_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")


def split_name(name: str) -> tuple[int | None, str]:
    """'layers.3.attn.q' -> (3, 'attn.q'); 'embed' -> (None, 'embed'). The kind is what plots group by."""
    m = _LAYER_RE.match(name)
    return (int(m.group(1)), m.group(2)) if m else (None, name)


def matches(name: str, patterns: list[str] | tuple[str, ...]) -> bool:
    """True if `name` matches any of the shell-style glob `patterns` (empty list: everything)."""
    return not patterns or any(fnmatch.fnmatchcase(name, p) for p in patterns)
