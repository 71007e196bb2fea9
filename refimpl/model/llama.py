"""The Llama 3.2 text forward, written once over the op interface and run by either backend.

`forward_steps` is a generator: it yields `(name, value)` for every activation in the order of
`refimpl.model.names.activation_names`, and a caller may `send()` a replacement value back (the step-through debugger
uses this to run two backends in lockstep or to inject faults). `forward` drives it to the end; the generator
costs a few microseconds per token, nothing against the matrix products.

Parameters are a flat dict keyed by the checkpoint's own names (`model.layers.0.self_attn.q_proj.weight`).
Arrays are whatever the backend's ops take: NumPy for refimpl, torch for accel's trace mode.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Generator

from refimpl.model.config import LlamaConfig

Steps = Generator[tuple[str, Any], Any, Any]


def emit(name: str, value):
    """Yield one named activation; return the value sent back in its place, or the value itself."""
    sent = yield name, value
    return value if sent is None else sent


@dataclass
class KVCache:
    """Per-layer key/value caches, each [K, S, E]; slot p holds the token at position p."""

    k: list
    v: list

    @classmethod
    def allocate(cls, cfg: LlamaConfig, capacity: int, zeros: Callable) -> "KVCache":
        shape = (cfg.num_key_value_heads, capacity, cfg.head_dim)  # [K, S, E]
        return cls([zeros(shape) for _ in range(cfg.num_hidden_layers)],
                   [zeros(shape) for _ in range(cfg.num_hidden_layers)])

    @property
    def capacity(self) -> int:
        return self.k[0].shape[1]


@dataclass(frozen=True)
class LoraWeight:
    """A base weight [Dout, Din] served with its unmerged LoRA pair: lora_a [R, Din], lora_b [Dout, R]."""

    weight: Any
    lora_a: Any
    lora_b: Any
    scale: float

    @property
    def shape(self):
        return self.weight.shape


def project(ops, x, w):
    """x @ wᵀ for a plain weight, or the unmerged LoRA sum for a LoraWeight."""
    if isinstance(w, LoraWeight):
        return ops.lora_linear(x, w.weight, w.lora_a, w.lora_b, w.scale)
    return ops.linear(x, w)


def lm_head(params: dict, cfg: LlamaConfig):
    """[V, D]; a tied model's lm_head is the embedding unless quantization gave it its own tensor."""
    return params.get("lm_head.weight", params["model.embed_tokens.weight"])


def attention_block(ops, p: dict, x, cfg: LlamaConfig, i: int, cos, sin, cache: KVCache, positions) -> Steps:
    n = f"layers.{i}."
    T = x.shape[0]
    h = yield from emit(n + "attn_norm", ops.rms_norm(x, p["input_layernorm.weight"], cfg.rms_norm_eps))
    H, K, E = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q = project(ops, h, p["self_attn.q_proj.weight"]).reshape(T, H, E)  # [T, D] -> [T, H, E]
    q = yield from emit(n + "attn.q", q)
    k = project(ops, h, p["self_attn.k_proj.weight"]).reshape(T, K, E)  # [T, D] -> [T, K, E]
    k = yield from emit(n + "attn.k", k)
    v = project(ops, h, p["self_attn.v_proj.weight"]).reshape(T, K, E)  # [T, D] -> [T, K, E]
    v = yield from emit(n + "attn.v", v)
    q_rot, k_rot = ops.rope(q, k, cos, sin)
    q_rot = yield from emit(n + "attn.q_rot", q_rot)
    k_rot = yield from emit(n + "attn.k_rot", k_rot)
    a = ops.attention(q_rot, k_rot, v, cache.k[i], cache.v[i], positions)  # -> [T, H, E]
    a = yield from emit(n + "attn.out", a)
    o = project(ops, a.reshape(T, cfg.q_size), p["self_attn.o_proj.weight"])  # [T, H·E] -> [T, D]
    o = yield from emit(n + "attn.o_proj", o)
    return (yield from emit(n + "resid_mid", x + o))


def mlp_branch(ops, p: dict, x, cfg: LlamaConfig, i: int) -> Steps:
    """The MLP's contribution to the residual stream, [T, D] (norm, SwiGLU, down projection)."""
    n = f"layers.{i}."
    h = yield from emit(n + "mlp_norm", ops.rms_norm(x, p["post_attention_layernorm.weight"], cfg.rms_norm_eps))
    gate = yield from emit(n + "mlp.gate", project(ops, h, p["mlp.gate_proj.weight"]))  # [T, D] -> [T, F]
    up = yield from emit(n + "mlp.up", project(ops, h, p["mlp.up_proj.weight"]))  # [T, D] -> [T, F]
    act = yield from emit(n + "mlp.act", ops.swiglu(gate, up))  # [T, F]
    return (yield from emit(n + "mlp.down", project(ops, act, p["mlp.down_proj.weight"])))  # [T, F] -> [T, D]


def mlp_block(ops, p: dict, x, cfg: LlamaConfig, i: int) -> Steps:
    down = yield from mlp_branch(ops, p, x, cfg, i)
    return (yield from emit(f"layers.{i}.resid_post", x + down))


_LAYER_KEYS = ("input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
               "self_attn.v_proj.weight", "self_attn.o_proj.weight", "post_attention_layernorm.weight",
               "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")


def layer_params(params: dict, i: int, prefix: str = "model.layers.") -> dict:
    """The layer's tensors, keyed by their names inside the layer (`self_attn.q_proj.weight`)."""
    return {key: params[f"{prefix}{i}.{key}"] for key in _LAYER_KEYS}


def forward_steps(ops, params: dict, cfg: LlamaConfig, ids, positions, cache: KVCache,
                  last_logits_only: bool = False) -> Steps:
    """ids [T], positions [T] (backend arrays). Yields every activation; returns logits [T, V] (or [1, V])."""
    x = yield from emit("embed", ops.embedding(ids, params["model.embed_tokens.weight"]))  # [T, D]
    cos, sin = ops.rope_tables(positions, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)  # [T, E/2] each
    for i in range(cfg.num_hidden_layers):
        p = layer_params(params, i)
        x = yield from attention_block(ops, p, x, cfg, i, cos, sin, cache, positions)
        x = yield from mlp_block(ops, p, x, cfg, i)
    x = yield from emit("final_norm", ops.rms_norm(x, params["model.norm.weight"], cfg.rms_norm_eps))
    if last_logits_only:
        x = x[-1:]  # generation needs only the next token's logits: skip T-1 rows of the largest GEMM
    return (yield from emit("logits", project(ops, x, lm_head(params, cfg))))  # [T, D] -> [T, V]


def run_steps(steps: Steps):
    """Drive a forward generator to the end and return its result (the logits)."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value


def forward(ops, params, cfg, ids, positions, cache, last_logits_only=False):
    return run_steps(forward_steps(ops, params, cfg, ids, positions, cache, last_logits_only))


def collect(ops, params, cfg, ids, positions, cache, keep: Callable[[str], bool] = lambda name: True):
    """Run a forward and return ({name: value} for the names `keep` accepts, logits)."""
    return drive(forward_steps(ops, params, cfg, ids, positions, cache), keep)


def drive(steps: Steps, keep: Callable[[str], bool]):
    """Run any step generator (a forward, one block) to its end: ({name: value} `keep` accepts, its result)."""
    out = {}
    while True:
        try:
            name, value = next(steps)
        except StopIteration as stop:
            return out, stop.value
        if keep(name):
            out[name] = value
