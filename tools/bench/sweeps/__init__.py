"""Sweeps over launch configs at the real shapes, whose winners are copied by hand into accel/kernels/tuning.py."""
