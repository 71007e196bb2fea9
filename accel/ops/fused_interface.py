"""The fused ops: what the engine's fast path (accel.model) runs besides the interface ops, documented once.

`refimpl.model.interface` documents the interface ops (one per step of the model, shared with the NumPy reference);
these are accel's own: each computes exactly a composition of interface ops, with the same roundings in the same
order, and exists because at batch 1 a launch (and its gap) costs as much as the work: fusing neighbours removes
launches, and keeping every size and the position on the device lets one CUDA graph serve every decode step.
`accel.ops.fused` implements each with a Triton kernel and one plain torch version (accel.ops.torch_ops);
tests/test_op_contracts.py checks the signatures, tests/test_accel_ops.py each op against refimpl's composition.

Dimension letters as in refimpl.model.interface (T S D F V H K E ...). Dtype rules as there: activations in the
model dtype, rms_norm's HF cast order, RoPE in fp32, attention scores and softmax in fp32, fp32 accumulation.
`position` is a [1] int64 device tensor (the new token's slot): read on the device, never on the host.
`tuning` (accel.kernels.tuning.Tuning) picks the kernels' launch configs; the torch versions ignore it.
A `weight` matrix is a plain tensor or a quantized one (accel.quant_ops.QuantTensor): the op calls the matrix's own
product of the same name (accel.ops.fused.matrix), so a quantized weight takes its quantized GEMV.

Prefill (T tokens):
    embedding_rms_norm the embedding gather + the first layer's attention norm: one launch, at the start.
    add_rms_norm       residual add + the next RMSNorm: one pass over the row instead of two.
    rope_kv_write      RoPE on q and k, rotated k and v written into the cache: one launch instead of three.
    swiglu_gate_up     SwiGLU over the fused [gate | up] GEMM output (accel.weights fuses the two weights).
    causal_attention   attention over the cache already holding this chunk's k/v (flash attention).
Decode (one token, the residual stream x [1, D] updated in place):
    qkv_rope           attn norm + qkv GEMV + RoPE + cache write: one launch.
    decode_attention   split-K attention over the cache, the length read from `position`.
    linear_add         o GEMV + residual add (a cross layer's: times its tanh gate first).
    norm_linear        mlp norm + gate_up GEMV (also final norm + lm_head, a cross layer's norm + q).
    swiglu_linear_add  SwiGLU + down GEMV + residual add (gated, as linear_add).
    norm_mlp_add       the whole MLP block in two launches, the SwiGLU wherever it costs least: in down's
                       prologue (norm_linear, swiglu_linear_add) for dense weights; in gate_up's epilogue for
                       quantized ones, whose GEMV pairs gate row i with up row i in one program.
Both (Llama 3.2 Vision's cross-attention layers):
    norm_cross_attention  q_norm + attention over the image tokens with the cross-attention mask (the decode
                          step: split along the image tokens; prefill: flash attention without the causal mask).
    argmax_row         greedy token, no host sync.
    greedy_next        argmax + the greedy loop's bookkeeping, inside the decode step's graph.
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from ..kernels.tuning import DEFAULT, Tuning

Tensor = Any  # torch.Tensor


@runtime_checkable
class FusedOps(Protocol):
    def embedding_rms_norm(self, ids: Tensor, table: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        """ids [T] int, table [V, D], weight [D] -> (x, rms_norm(x, weight, eps)), x = embedding(ids, table)
        [T, D] (an exact copy of the rows)."""

    def add_rms_norm(self, x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        """x, residual [T, D], weight [D] -> (s, rms_norm(s, weight, eps)), s = x + residual rounded to x's dtype
        before the norm reads it (as the unfused `x + r` does)."""

    def rope_kv_write(self, q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, cache_k: Tensor,
                      cache_v: Tensor, positions: Tensor) -> Tensor:
        """q [T, H, E], k/v [T, K, E], cos/sin [T, E/2] fp32, cache_k/cache_v [K, S, E], positions [T] int ->
        rope(q) [T, H, E]; rope(k) and v are written into the caches at `positions` (in place)."""

    def swiglu_gate_up(self, gate_up: Tensor) -> Tensor:
        """gate_up [T, 2F] (gate = first F columns, up = last F) -> swiglu(gate, up), [T, F]."""

    def causal_attention(self, q: Tensor, cache_k: Tensor, cache_v: Tensor, positions: Tensor) -> Tensor:
        """q [T, H, E] (rotated) at positions [T] over cache_k/cache_v [K, S, E], whose slots 0..max(positions)
        hold this sequence -> [T, H, E]: query t sees slots 0..positions[t]; head h reads kv head h // (H/K)."""

    def decode_attention(self, q: Tensor, cache_k: Tensor, cache_v: Tensor, position: Tensor,
                         tuning: Tuning = DEFAULT) -> Tensor:
        """q [1, H, E] over cache slots 0..position -> [1, H, E]. The work does not depend on the host knowing
        the position (the grid covers the capacity S; splits past the length do nothing). On the GPU it may start
        before the previous kernel has finished (PDL): that kernel may write q and the cache, never `position`."""

    def qkv_rope(self, x: Tensor, norm_weight: Tensor, weight: Tensor, eps: float, cos: Tensor, sin: Tensor,
                 position: Tensor, cache_k: Tensor, cache_v: Tensor, tuning: Tuning = DEFAULT) -> Tensor:
        """x [1, D], norm_weight [D], weight [(H+2K)·E, D] (rows q, k, v), cos/sin [S, E/2] fp32 (whole tables:
        row `position` is read on the device) -> rope(q) [1, H, E]; rope(k), v written at slot `position`.
        = rope_kv_write(split(linear(rms_norm(x), weight)), cos[position], sin[position], ...)."""

    def norm_linear(self, x: Tensor, norm_weight: Tensor, weight: Tensor, eps: float,
                    tuning: Tuning = DEFAULT) -> Tensor:
        """x [1, D], norm_weight [D], weight [N, D] -> linear(rms_norm(x, norm_weight, eps), weight), [1, N]."""

    def linear_add(self, a: Tensor, weight: Tensor, residual: Tensor, tuning: Tuning = DEFAULT,
                   gate: Tensor | None = None, accumulate: bool = True) -> Tensor:
        """a [1, Din], weight [D, Din], residual [1, D] -> residual += linear(a, weight) in place (the product
        rounded to the dtype before the add); returns residual. gate [1] (a device tensor, model dtype):
        residual += gate · linear(a, weight), the product rounded before the add. accumulate False:
        residual = [gate ·] linear(a, weight), overwritten (a tensor-parallel rank's partial sum, accel.tp.model)."""

    def swiglu_linear_add(self, gate_up: Tensor, weight: Tensor, residual: Tensor,
                          tuning: Tuning = DEFAULT, gate: Tensor | None = None, accumulate: bool = True) -> Tensor:
        """gate_up [1, 2F], weight [D, F], residual [1, D] -> residual += linear(swiglu_gate_up(gate_up), weight)
        in place (times gate first, as linear_add; accumulate False: overwritten, as linear_add); returns
        residual."""

    def norm_mlp_add(self, x: Tensor, norm_weight: Tensor, gate_up: Tensor, down: Tensor, eps: float,
                     tuning: Tuning = DEFAULT, accumulate: bool = True) -> Tensor:
        """x [1, D], norm_weight [D], gate_up [2F, D] (rows gate, then up), down [D, F] -> x += linear(
        swiglu_gate_up(norm_linear(x, norm_weight, gate_up, eps)), down) in place, the same roundings; returns x.
        accumulate False: x = that product, overwritten once the norm has read x (as linear_add)."""

    def norm_cross_attention(self, q: Tensor, norm_weight: Tensor, eps: float, keys: Tensor, values: Tensor,
                             visible: Tensor, tuning: Tuning = DEFAULT) -> Tensor:
        """q [T, H, E], norm_weight [E], keys/values [K, N, E], visible [T, N] bool -> [T, H, E]:
        attention of rms_norm(q, norm_weight, eps) (per head) over every key n with visible[t, n], no causal
        mask; head h reads kv head h // (H/K). Every row must see a key (Mllama's rows before the first image
        attend to all of them: the caller passes visible | ~row_has_image)."""

    def argmax_row(self, logits: Tensor) -> Tensor:
        """logits [1, V] or [V] -> [1] int64, the first index of the maximum (NaN counts as the largest, as
        torch.argmax), on the device with no host sync."""

    def greedy_next(self, logits: Tensor, token: Tensor, position: Tensor, history: Tensor,
                    step: Tensor) -> Tensor:
        """token = argmax_row(logits); history[step] = token; step += 1; position += 1 — all in place on the
        device ([1], [1], [n], [1] int64); returns token."""


FUSED_OP_NAMES: tuple[str, ...] = ("embedding_rms_norm", "add_rms_norm", "rope_kv_write", "swiglu_gate_up",
                                   "causal_attention", "decode_attention", "qkv_rope", "norm_linear", "linear_add",
                                   "swiglu_linear_add", "norm_mlp_add", "norm_cross_attention", "argmax_row",
                                   "greedy_next")
