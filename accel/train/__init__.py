"""Training pieces of the accel backend: differentiable ops over the Triton kernels (attention.py: FlashAttention
forward and backward)."""
