"""Training pieces of the accel backend: autograd-wrapped kernels (attention.py), ..."""
