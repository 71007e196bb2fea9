"""Triton kernels, one family a file (the @triton.jit kernels and their Python launcher `*_fwd`), called through
the op layer accel.ops. `common.py` holds the Triton helpers several kernels share; `tuning.py` the measured
launch tables (plain data, passed to the launchers as `table=` or an explicit `config=`)."""
