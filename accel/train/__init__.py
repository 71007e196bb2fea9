"""Training pieces of the accel backend: differentiable ops over the Triton kernels (attention.py: FlashAttention
forward and backward; fused.py: RMSNorm, RoPE, SwiGLU; loss.py: lm_head + cross-entropy), one decoder layer with a
hand-written backward (layer.py), LoRA (lora.py), the training forward (model.py), the optimisation loop (loop.py),
PEFT adapter files (adapter.py), what a run on a text checkpoint adapts (text_training.py), one run put together
(session.py); Llama 3.2 Vision's training forward with the vision tower frozen (vision_model.py) and what its run
changes (vision_training.py)."""
