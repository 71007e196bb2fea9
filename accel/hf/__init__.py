"""llama32's Triton kernels inside Hugging Face transformers.

    import accel.hf
    accel.hf.register()  # once; idempotent
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="llama32")
    # or, on a loaded model: model.set_attn_implementation("llama32") / model.config._attn_implementation = "llama32"

    accel.hf.apply(model)  # optional: RMSNorm, SwiGLU MLP, RoPE -> Triton forward + backward (revert undoes);
                           # fused_linear_cross_entropy=True, lora=True (PEFT's LoRA as Functions, bf16) on request

attention.py: the attention function (FlashAttention forward + backward, GQA-native, masks, fallbacks to SDPA);
patch.py: the module patch, a table by model_type; lora.py / mlp.py / qkv.py: PEFT's LoRA Linear, HF's MLP and
a self-attention's q, k, v + RoPE as one autograd Function each (lora=True); offload.py: gradient checkpointing with
the layer inputs on the host (offload_checkpoints=True); memo.py: what is derived once per tensor (masks, RoPE tables).
"""
from __future__ import annotations

from accel.hf.attention import attention_forward, fallback_counts, reset_fallbacks
from accel.hf.patch import apply, revert

NAME = "llama32"

__all__ = ["NAME", "register", "apply", "revert", "attention_forward", "fallback_counts", "reset_fallbacks"]


def register() -> str:
    """Register "llama32" with transformers' AttentionInterface (the attention function) and AttentionMaskInterface
    (the masks are SDPA's: without a mask function registered, transformers would build no mask at all, padding
    included). Idempotent. -> the name to pass as attn_implementation."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME
