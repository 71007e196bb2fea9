"""accel's one op layer: every op either engine path runs, each a Triton kernel (accel/kernels/<op>.py) or its one
plain torch version (accel/ops/torch_ops.py), picked per call by accel/ops/dispatch.py.

    interface.py        the op interface of refimpl.model.interface (trace mode runs forward_steps over these)
    fused.py            the fast path's fused ops (accel.model), contract in fused_interface.py
    dense.py            a plain weight tensor's products (the fused ops call a weight matrix's own method; a
                        quantized matrix, accel.quant_ops.QuantTensor, has the same methods with its kernels)
    torch_ops.py        the torch version of each
    paged.py            the batched engine's (accel.batch): paged decode attention, the linear layers (cuBLAS or
                        the weight-streaming GEMM by the MATMUL table) and their batch-invariant version
    lora_batch.py       many LoRA adapters in one batch, unmerged (the segmented product)
`from accel import ops` gives the interface and fused ops: `ops.rms_norm(...)`, `ops.qkv_rope(...)`; the batched
engine's are imported from their modules.
"""
from .dispatch import INTERPRET, torch_only, triton_available, uses_triton
from .fused import (add_rms_norm, argmax_row, causal_attention, decode_attention,
                    embedding_rms_norm, greedy_next, linear_add, norm_cross_attention, norm_linear, norm_mlp_add,
                    qkv_rope, rope_kv_write, swiglu_gate_up, swiglu_linear_add)
from .fused_interface import FUSED_OP_NAMES, FusedOps
from .interface import (attention, cross_attention, embedding, encoder_attention, gelu, layer_norm, linear,
                        lora_linear, lora_merge, rms_norm, rope, rope_tables, swiglu)

__all__ = ["INTERPRET", "torch_only", "triton_available", "uses_triton", "FUSED_OP_NAMES", "FusedOps",
           "add_rms_norm", "argmax_row", "causal_attention", "decode_attention",
           "embedding_rms_norm", "greedy_next",
           "linear_add", "norm_cross_attention", "norm_linear", "norm_mlp_add", "qkv_rope", "rope_kv_write",
           "swiglu_gate_up", "swiglu_linear_add",
           "attention", "cross_attention", "embedding", "encoder_attention", "gelu", "layer_norm", "linear",
           "lora_linear", "lora_merge", "rms_norm", "rope", "rope_tables", "swiglu"]
