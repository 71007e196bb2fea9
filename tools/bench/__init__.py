"""Benchmarks, run from a checkout (not installed with the package): scripts that print a table and write a JSON
record (`--json-out`), never tests. Live benchmarks (gpu, quant_gpu, vision, train behind `llama32 bench`; agreement,
quant_quality, cpu, startup, load as `python3 -m tools.bench.<name>`) are leaves over common/ (one helper package);
sweeps/ holds the sweeps that regenerate accel/kernels/tuning.py's launch tables; results/ the records
docs/performance.md cites."""
