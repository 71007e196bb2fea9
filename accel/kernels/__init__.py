"""Triton kernels, one op a file with its forward and, where training needs one, its backward (the @triton.jit
kernels and their Python launchers `*_fwd` / `*_bwd`), called through the op layer accel.ops (the inference
engine) and accel.train (training). `common.py` holds the Triton helpers several kernels share; `tuning.py` the
measured launch tables and constants (plain data, passed to the launchers as `table=` or an explicit `config=`)."""
