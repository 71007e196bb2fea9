"""Training pieces of the accel backend: autograd-wrapped kernels (attention.py), LoRA (lora.py), the training
forward (model.py), the optimisation loop (loop.py), PEFT adapter files (adapter.py), a run put together (session.py)."""
