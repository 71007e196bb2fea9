"""NumPy gradient oracles for training (grads.py): the backward of every op a LoRA fine-tune runs through."""
