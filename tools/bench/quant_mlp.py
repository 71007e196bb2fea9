"""The quantized decode MLP as one chained launch (accel/kernels/qmlp.py) against its two kernels, in the engine, one
process, the same weights (tools/bench/NOTES.md, "decode MLP as one launch").

`python3 -m tools.bench.quant_mlp [OUT_DIR] [--models=1b,3b] [--specs=int8,int4:64] [--profile]`: for each model the
bf16 engine's greedy decode tok/s, then for each format every VARIANTS row in order, then the first (the two
kernels) again: drift shows as a gap between its two rates (tools.bench.quant_roles.rate_within: 32-token prompt,
256 tokens, median of 3); the greedy tokens checked equal to the two kernels'. --profile: per kernel of the replayed
graph (tools.bench.quant_roles.step_profile) for the two kernels and the first chained row. Writes
OUT_DIR/quant_mlp.json after each model.
"""
from __future__ import annotations

import contextlib
import gc
import json
import time

import torch

from accel.kernels.qgemv import PdlMode
from accel.kernels.tuning import QMlpConfig
from accel.quant_ops import decode_pdl, mlp_chained
from refimpl.model.config import PRESETS
from refimpl.quant.schemes import QuantSpec
from tools.bench.decode_variants import NAMES
from tools.bench.quant_roles import (bench_args, bench_parser, bf16_rate, profile_within, quant_random_weights,
                                     rate_within)

# (name, chained (None: the default), the chained launch's QMlpConfig (None: tuning.QMLP's, else gate_up's warps
#  and down's own tiles), the quantized kernels' launch mode ("default": PDL_DEFAULT's)); the first row is the
#  baseline, timed again after the rest (drift)
VARIANTS = {
    "int8": [("two kernels", False, None, "default"),
             ("chained, 2 warps", True, QMlpConfig(2), "default"),
             ("chained, 2 warps, no prefetch", True, QMlpConfig(2, prefetch=False), "default"),
             ("chained, 2 warps, down 16 x 512 / 4 slices", True, QMlpConfig(2, (16, 512, 2, 4, 3)), "default"),
             ("chained, 2 warps, down 16 x 512 / 16 slices", True, QMlpConfig(2, (16, 512, 2, 16, 1)), "default")],
    # at 2 warps down's rule tile (8 × 4096 columns, 2 slices) spills (sm_90 SASS): narrower tiles, more slices
    "int4": [("two kernels", False, None, "default"),
             ("chained, 4 warps", True, QMlpConfig(4), "default"),
             ("chained, 2 warps, down 8 x 2048 / 4 slices", True, QMlpConfig(2, (8, 2048, 2, 4, 1)), "default"),
             ("chained, 2 warps, down 8 x 1024 / 8 slices", True, QMlpConfig(2, (8, 1024, 2, 8, 1)), "default"),
             ("chained, 2 warps, down 8 x 2048 / 4, pdl late", True, QMlpConfig(2, (8, 2048, 2, 4, 1)),
              PdlMode("late", 1))],
}


@contextlib.contextmanager
def variant_context(chained, launch, mode):
    """Within: the MLP chained (with `launch`) or not, every quantized kernel in launch `mode`."""
    with mlp_chained(chained, launch), (contextlib.nullcontext() if mode == "default" else decode_pdl(mode)):
        yield


def compare(model: str, specs: list[str], profile: bool) -> list[dict]:
    cfg = PRESETS[NAMES[model]]
    rows = [bf16_rate(cfg, model)]
    bf16 = rows[0]["decode_tok_s"]
    for spec in specs:
        weights = quant_random_weights(cfg, spec)
        variants = VARIANTS[QuantSpec.parse(spec).format]
        rates: dict[str, list[float]] = {}
        tokens = {}
        for name, chained, launch, mode in variants + variants[:1]:
            rate, tokens[name] = rate_within(cfg, weights, variant_context(chained, launch, mode))
            rates.setdefault(name, []).append(rate)
            print(f"{model} {spec:<8} {name:<44} {rate:8.1f} tok/s  {rate / bf16:5.3f}x bf16", flush=True)
        base = max(rates[variants[0][0]])
        for name, chained, launch, mode in variants:
            row = {"model": model, "quant": spec, "variant": name, "chained": chained,
                   "launch": launch and launch._asdict(), "mode": mode if mode == "default" else mode._asdict(),
                   "decode_tok_s": rates[name], "x_bf16": max(rates[name]) / bf16,
                   "x_two_kernels": max(rates[name]) / base, "tokens_equal_two_kernels": tokens[name] ==
                   tokens[variants[0][0]]}
            if profile and name in (variants[0][0], variants[1][0]):
                row["profile"] = profile_within(cfg, weights, variant_context(chained, launch, mode),
                                                f"{model} {spec} {name}")
            rows.append(row)
            differ = "" if row["tokens_equal_two_kernels"] else "  TOKENS DIFFER"
            print(f"{model} {spec:<8} {name:<44} best {max(rates[name]):8.1f} tok/s  {row['x_bf16']:5.3f}x bf16  "
                  f"x{row['x_two_kernels']:.3f} two kernels{differ}", flush=True)
        del weights
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def main(argv=None):
    ap = bench_parser("tools.bench.quant_mlp", __doc__)
    ap.add_argument("--profile", action="store_true", help="per kernel of the graph replays (torch.profiler)")
    args, models, specs, res = bench_args(ap, argv)
    if any(QuantSpec.parse(s).format not in VARIANTS for s in specs):
        ap.error(f"--specs {args.specs}: expected int8 or int4[:G] formats (the chained MLP's)")
    t0 = time.time()
    for m in models:
        res["rows"] += compare(m, specs, args.profile)
        with open(f"{args.out_dir}/quant_mlp.json", "w") as f:  # after each model: a run cut short keeps it
            json.dump(res, f, indent=1)
    print(f"total {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
