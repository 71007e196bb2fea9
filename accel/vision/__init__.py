"""Llama 3.2 Vision on the accel backend.

    weights.py   device weights: the text decoder's self-attention layers fused as accel.weights does, the rest
                 (vision encoder, projector, cross-attention layers) by their checkpoint names
    encoder.py   the fast vision encoder + projector: every tile of every image in one batched pass
    model.py     the fast text forward: prefill and the capturable decode step, with the cross-attention layers
                 reading image keys/values computed once per request into their own static buffers
    engine.py    VisionAccelEngine: VisionEngine's contract (trace mode over accel.ops, generate with images)
"""
