"""Training in NumPy terms: gradient oracles (grads.py), the backward of every op a LoRA fine-tune runs through; chat
data -> token ids and labels (data.py), shared by every trainer."""
