"""The quantized decode MLP's two layouts, in one process (accel.quant_ops.swiglu_in_gate_up): the SwiGLU in
gate_up's epilogue (then down's plain GEMV) against the SwiGLU in down's prologue. Batch-1 greedy decode rate,
random weights at the real shapes, the two alternated (on, off, off, on) so drift hits both; the greedy tokens
of both are compared.

    python3 -m tools.bench.quant_swiglu [OUT_DIR] [--models=1b,3b] [--specs=int8,int4:64]
"""
from __future__ import annotations

import gc
import json

import torch

from accel.quant_ops import swiglu_in_gate_up
from refimpl.model.config import PRESETS
from tools.bench.decode_variants import NAMES
from tools.bench.quant_roles import bench_args, bench_parser, quant_random_weights, rate_within


def compare(model: str, specs: list[str]) -> list[dict]:
    cfg = PRESETS[NAMES[model]]
    rows = []
    for spec in specs:
        weights = quant_random_weights(cfg, spec)
        runs = {True: [], False: []}
        tokens = {}
        for on in (True, False, False, True):
            rate, tokens[on] = rate_within(cfg, weights, swiglu_in_gate_up(on))
            runs[on].append(rate)
        row = {"model": model, "quant": spec, "epilogue_tok_s": runs[True], "prologue_tok_s": runs[False],
               "speedup": max(runs[True]) / max(runs[False]), "tokens_equal": tokens[True] == tokens[False]}
        print(f"{model} {spec:<8} gate_up epilogue {max(runs[True]):8.1f} tok/s  down prologue "
              f"{max(runs[False]):8.1f} tok/s  ×{row['speedup']:.3f}  tokens equal: {row['tokens_equal']}",
              flush=True)
        rows.append(row)
        del weights
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def main(argv=None):
    args, models, specs, res = bench_args(bench_parser("tools.bench.quant_swiglu", __doc__), argv)
    for m in models:
        res["rows"] += compare(m, specs)
        with open(f"{args.out_dir}/quant_swiglu.json", "w") as f:  # after each model: a run cut short keeps it
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
