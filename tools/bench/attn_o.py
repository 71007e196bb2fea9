"""The decode step's attention + o projection as one launch (accel/kernels/attn_o.py) against the two launches, in
the engine, one process, the same weights (tools/bench/NOTES.md, "attention + o in one launch").

`python3 -m tools.bench.attn_o [OUT_DIR] [--models=1b,3b] [--specs=int8,int4:64] [--long=8192] [--o-configs]
[--profile=int8]`:
per model, bf16 and then each format, greedy decode tok/s (tools.bench.quant_roles.rate_within: 32-token prompt, 256
tokens, median of 3) for each WAYS row, × the bf16 two-launch rate of the same process, the first 16 greedy tokens
beside the two launches'. --o-configs: O_CONFIGS' tiles for o inside the one launch. --long N: the same ways at a
long context (quantized formats): a prompt of N − 128 tokens into a session of N slots (N >= LONG_CONTEXT: the long-
cache attention), 128 tokens. --profile=SPECS: per kernel of the replayed graph, both ways, for those formats
(tools.bench.quant_roles.step_profile).
Writes OUT_DIR/attn_o.json after each model.
"""
from __future__ import annotations

import contextlib
import json
import time

import torch

from accel.engine import AccelEngine
from accel.kernels import attn_o
from accel.kernels.attn_o import chained_launch
from accel.kernels.tuning import QGemvConfig, Tuning
from accel.weights import random_weights
from refimpl.model.config import PRESETS
from tools.bench.decode_variants import NAMES
from tools.bench.gpu import decode_rate
from tools.bench.quant_roles import bench_args, bench_parser, profile_within, quant_random_weights, rate_within

# (name, chained_launch's value, the decode attention's options)
WAYS = [("two launches", False, {}), ("one launch", True, {}),
        ("one launch, PDL behind qkv_rope", True, {"config": {"PDL": True}})]
# o's tiles inside the one launch, per (model, format): QGemvConfig (block_n, block_k, warps unused, split_k, stages)
O_CONFIGS = {
    ("1b", "int8"): [(16, 2048, 4, 1, 1), (8, 1024, 4, 2, 1)],
    ("3b", "int8"): [(8, 1024, 4, 3, 1), (8, 4096, 4, 1, 1)],
    ("1b", "int4:64"): [(16, 2048, 4, 1, 1), (8, 1024, 4, 2, 1)],
    ("3b", "int4:64"): [(8, 1024, 4, 3, 1), (16, 4096, 4, 1, 1)],
    ("1b", "bf16"): [(8, 1024, 4, 2, 1)],
    ("3b", "bf16"): [(8, 512, 4, 6, 1)],
}


@contextlib.contextmanager
def o_tiles(config: tuple | None):
    """o's tiles in the one launch replaced by `config` (None: the table / rule's)."""
    orig = attn_o.attn_o_config
    if config is not None:
        attn_o.attn_o_config = lambda *args, **kw: QGemvConfig(*config)
    try:
        yield
    finally:
        attn_o.attn_o_config = orig


@contextlib.contextmanager
def _within(chained: bool, config: tuple | None = None):
    with chained_launch(chained), o_tiles(config):
        yield


def long_rate(cfg, weights, chained: bool, slots: int, new_tokens: int = 128) -> tuple[float, list[int]]:
    """Greedy decode tok/s after a prompt of slots − new_tokens tokens (median of 3)."""
    with _within(chained):
        eng = AccelEngine(cfg, weights, torch.device("cuda"), "bf16", tuning=Tuning())
        rate, _, tokens = decode_rate(eng, slots - new_tokens, new_tokens, reps=3)
    del eng
    torch.cuda.empty_cache()
    return rate, tokens


def compare(model: str, specs: list[str], o_configs: bool, long: int, profile: list[str]) -> list[dict]:
    cfg = PRESETS[NAMES[model]]
    bf16_weights = random_weights(cfg, "cuda", torch.bfloat16, seed=0)
    rows, base = [], None
    for spec in specs:
        weights = bf16_weights if spec == "bf16" else quant_random_weights(cfg, spec)
        first = None
        ways = [(n, c, a, None) for n, c, a in WAYS]
        ways += [(f"one launch, o tiles {oc}", True, {}, oc) for oc in O_CONFIGS.get((model, spec), [])
                 if o_configs]
        for name, chained, attention, oc in ways:
            try:
                rate, tokens = rate_within(cfg, weights, _within(chained, oc), Tuning(decode_attention=attention))
            except Exception as e:  # a variant that does not compile or launch is reported, not fatal
                print(f"{model} {spec} {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            base = rate if base is None else base  # the bf16 two launches: the first row
            first = tokens if first is None else first
            rows.append({"model": model, "quant": spec, "way": name, "o_config": oc, "attention": attention,
                         "decode_tok_s": rate, "x_bf16": rate / base, "tokens": tokens[:16],
                         "tokens_equal_two_launches": tokens == first})
            print(f"{model} {spec:8} {name:<44} {rate:8.1f} tok/s  x bf16 {rate / base:.3f}  same tokens "
                  f"{tokens == first}", flush=True)
        for chained in (False, True) if spec in profile else ():
            way = "one launch" if chained else "two launches"
            prof = profile_within(cfg, weights, _within(chained), f"{model} {spec} {way}")
            rows.append({"model": model, "quant": spec, "way": way, "profile": prof})
        if long and spec != "bf16":  # bf16 chains only where forced: its long caches are not asked about
            got = {}
            for chained in (False, True):
                rate, tokens = long_rate(cfg, weights, chained, long)
                got[chained] = tokens
                rows.append({"model": model, "quant": spec, "way": ("one launch" if chained else "two launches")
                             + f", {long}-slot context", "decode_tok_s": rate, "tokens": tokens[:16],
                             "tokens_equal_two_launches": tokens == got[False]})
                print(f"{model} {spec:8} {long}-slot context, {'one launch' if chained else 'two launches':<14}"
                      f" {rate:8.1f} tok/s  same tokens {tokens == got[False]}", flush=True)
        del weights
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = bench_parser("tools.bench.attn_o", __doc__)
    ap.add_argument("--long", type=int, default=0, help="also decode at a context of this many slots")
    ap.add_argument("--o-configs", action="store_true", help="also o's tiles of O_CONFIGS in the one launch")
    ap.add_argument("--profile", default="", help="formats whose replayed graph is profiled both ways")
    args, models, specs, res = bench_args(ap, argv)
    for m in models:
        res["rows"] += compare(m, ["bf16"] + specs, args.o_configs, args.long, args.profile.split(","))
        with open(f"{args.out_dir}/attn_o.json", "w") as f:
            json.dump(res, f, indent=1)
    print(f"done {time.strftime('%H:%M:%S')}", flush=True)


if __name__ == "__main__":
    main()
