"""The op interface: every op of a Llama 3.2 forward, documented once. Both backends implement exactly this.

`refimpl.model.ops` implements it on NumPy float32 arrays; `accel.ops` on torch tensors (bf16 or fp32, any device).
A backend is a module (or object) with one function per name in `OP_NAMES`, with these signatures;
`tests/test_interface.py` checks both backends against `Ops` and each op differentially on odd shapes.

Dimension letters, used in every shape comment of the project:
    T  tokens in this call            S  KV-cache capacity (positions)     D  hidden_size
    F  intermediate_size              V  vocab_size                         H  query heads
    K  key/value heads (H % K == 0)   E  head_dim                           R  LoRA rank
    N  cross-attention (image) tokens   B  sequences in a training batch

Vision letters (the image encoder of Llama 3.2 Vision; H and E there are the encoder's heads and head_dim):
    I  images in the prompt           A  tiles per image (max_num_tiles)    C  colour channels
    X  tile side in pixels            Z  patch side in pixels (14)          P  tokens per tile: patches + class
    Q  P padded to a multiple of 8    L  encoder sequence, A·Q              U  encoder hidden_size
    M  encoder intermediate_size      J  intermediate layers kept           O  vision_output_dim, U·(1 + J)

Dtype rules (accel; the refimpl is float32 throughout):
    * activations flow in the model dtype (bf16 or fp32); weights are in the model dtype;
    * rms_norm reduces in fp32, casts the normalized value back to the input dtype, *then* multiplies by the weight
      (HF's order; other orders give visibly different bf16 results);
    * rope tables are fp32; the rotation is computed in fp32 and cast back to the input dtype;
    * attention and cross_attention accumulate scores and softmax in fp32;
    * integer inputs (ids, positions) are int64 (NumPy) or any integer tensor (torch).
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from refimpl.model.config import RopeScaling

Array = Any  # np.ndarray in refimpl, torch.Tensor in accel


@runtime_checkable
class Ops(Protocol):
    def embedding(self, ids: Array, table: Array) -> Array:
        """Row gather. ids [T] int, table [V, D] -> [T, D]. Ids outside [0, V) are the caller's error."""

    def rms_norm(self, x: Array, weight: Array, eps: float) -> Array:
        """x [T, D], weight [D] -> x / sqrt(mean(x², -1) + eps) * weight, [T, D] (cast order: module doc)."""

    def rope_tables(self, positions: Array, head_dim: int, theta: float,
                    scaling: RopeScaling | None) -> tuple[Array, Array]:
        """positions [T] int -> (cos, sin), each [T, E/2] fp32, for frequencies theta^(-2i/E) with llama3 scaling.

        Computed as HF does (inverse frequencies in fp32, angle = position · inv_freq in fp32) so that logits
        agree to 1e-4 even at positions far past original_max_position_embeddings.
        """

    def rope(self, q: Array, k: Array, cos: Array, sin: Array) -> tuple[Array, Array]:
        """Rotate q [T, H, E] and k [T, K, E] with HF's half-split ("rotate_half") layout:
        out[..., :E/2] = x1·cos − x2·sin, out[..., E/2:] = x2·cos + x1·sin, with cos/sin [T, E/2]."""

    def linear(self, x: Array, weight: Array) -> Array:
        """x [T, Din], weight [Dout, Din] (the checkpoint's layout) -> x @ weightᵀ, [T, Dout]. No bias (Llama).
        weight may be quantized (refimpl.quant.schemes.QuantizedLinear, accel.quant_ops.QuantTensor): the product
        is by its dequantized values."""

    def attention(self, q: Array, k: Array, v: Array, cache_k: Array, cache_v: Array,
                  positions: Array) -> Array:
        """Causal GQA attention with a KV cache.

        q [T, H, E], k/v [T, K, E] (k already rotated), cache_k/cache_v [K, S, E], positions [T] int.
        First writes k/v into the caches at `positions` (in place), then each query t attends to cache slots
        0..positions[t] inclusive; query head h reads kv head h // (H/K). Scale 1/sqrt(E). -> [T, H, E].
        The cache slots below min(positions) must already hold this sequence's keys/values.
        """

    def swiglu(self, gate: Array, up: Array) -> Array:
        """gate/up [T, F] -> silu(gate) · up, [T, F]."""

    def cross_attention(self, q: Array, k: Array, v: Array, mask: Array | None = None) -> Array:
        """Non-causal GQA attention of text queries over precomputed image keys/values (Llama 3.2 Vision).

        q [T, H, E], k/v [K, N, E], mask [T, N] bool (True = may attend) or None (all visible) -> [T, H, E].
        A query row with no visible key outputs zeros (Meta's reference zeroes such rows so). HF's Mllama, which
        refimpl.model.llama_vision reproduces, never passes such a row: it lets it attend to every image token.
        """

    def lora_merge(self, weight: Array, lora_a: Array, lora_b: Array, scale: float) -> Array:
        """weight [Dout, Din], lora_a [R, Din], lora_b [Dout, R] -> weight + scale · (lora_b @ lora_a), computed
        in fp32 and cast to weight's dtype (merging in bf16 rounds twice). PEFT: scale = alpha/r, or
        alpha/sqrt(r) with use_rslora."""

    def lora_linear(self, x: Array, weight: Array, lora_a: Array, lora_b: Array, scale: float) -> Array:
        """Unmerged LoRA: x [T, Din], weight [Dout, Din], lora_a [R, Din], lora_b [Dout, R] ->
        x @ weightᵀ + scale · (x @ lora_aᵀ) @ lora_bᵀ, [T, Dout]; the base weights stay untouched. The LoRA branch
        is computed in fp32 (as PEFT casts x to the adapter's dtype) and the sum cast to x's dtype."""


@runtime_checkable
class VisionOps(Protocol):
    """The extra ops of the Llama 3.2 Vision encoder (accel: `accel.ops`, beside the text ops)."""

    def layer_norm(self, x: Array, weight: Array, bias: Array, eps: float) -> Array:
        """x [..., U], weight/bias [U] -> (x − mean) / sqrt(var + eps) · weight + bias, biased variance over the
        last axis (torch's LayerNorm), [..., U]. Reduces in fp32."""

    def gelu(self, x: Array) -> Array:
        """x · Φ(x) with the exact erf form of the normal CDF (torch's default GELU, HF's ACT2FN['gelu']), [...]."""

    def encoder_attention(self, q: Array, k: Array, v: Array, mask: Array | None = None) -> Array:
        """Non-causal attention within one sequence (the vision encoder; no cache, no RoPE).

        q [L, H, E], k/v [L, K, E], mask [L, L] bool (True = may attend) or None (all visible) -> [L, H, E].
        Scale 1/sqrt(E); every row must see at least one key (the encoder's padding mask guarantees it).
        """


VISION_OP_NAMES: tuple[str, ...] = ("layer_norm", "gelu", "encoder_attention")

OP_NAMES: tuple[str, ...] = ("embedding", "rms_norm", "rope_tables", "rope", "linear", "attention", "swiglu",
                             "cross_attention", "lora_merge", "lora_linear")
