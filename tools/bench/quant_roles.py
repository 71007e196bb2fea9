"""The quantized decode step kernel by kernel, as the engine runs it now (the SwiGLU in gate_up's epilogue): a launch
mode (accel.kernels.qgemv.PdlMode or plain) and a launch config per role, in the engine beside bf16, one process,
and where the step's time goes inside the replayed CUDA graph (tools/bench/NOTES.md, int8 decode speed).

`python3 -m tools.bench.quant_roles [OUT_DIR] [--models=1b,3b] [--specs=int8] [--profile | --search]`: for each model
the bf16 engine's greedy decode tok/s, then for each format every VARIANTS row (tools.bench.quant_pdl.rate_within:
32-token prompt, 256 tokens, median of 3; greedy tokens checked equal to the first row's). --profile: per kernel of the
graph replays (torch.profiler, 16 greedy steps): mean device time and the gap from the previous kernel's end (< 0:
overlap under PDL), per position in a layer, for bf16 and each format under PROFILED's variants. --search (int8):
`search`, each role's CANDIDATES in the engine; the winners are printed and written, not put in any table.
Writes OUT_DIR/quant_roles.json after each model.
"""
from __future__ import annotations

import contextlib
import gc
import json
import statistics
import time
from types import MappingProxyType

import torch

from accel import quant_ops
from accel.engine import AccelEngine
from accel.kernels import qgemv, tuning
from accel.kernels.qgemv import PdlMode
from accel.quant_layers import quantize_weights
from accel.quant_ops import decode_pdl
from accel.weights import random_weights
from refimpl.model.config import PRESETS
from refimpl.quant.formats import QuantSpec
from tools.bench.decode_variants import NAMES
from tools.bench.gpu import prompt_ids
from tools.bench.qgemv_sweep import shapes
from tools.bench.quant_pdl import bench_args, bench_parser, rate_within

ROLES = ("qkv", "o", "gate_up", "down", "lm_head")
P1, P0 = PdlMode("wait", 1), PdlMode("wait", 0)
ALL = lambda mode, **but: {r: but.get(r, mode) for r in ROLES}  # noqa: E731
# (name, {role: mode; missing: plain launches}, {(model, role): a QGemvConfig tuple for that role's weight})
VARIANTS = [
    ("plain", {}, {}),
    ("pdl all, prefetch 1 tile", ALL(P1), {}),
    ("pdl all, no prefetch", ALL(P0), {}),
    ("pdl all but down, prefetch 1 tile", ALL(P1, down=None), {}),
    ("pdl all but down, no prefetch", ALL(P0, down=None), {}),
    ("pdl down only, no prefetch", {"down": P0}, {}),
    ("pdl all, down late trigger", ALL(P1, down=PdlMode("late", 0)), {}),
    ("pdl all late, no prefetch", ALL(PdlMode("late", 0)), {}),
    ("plain, down 1 warp 8 slices", {}, {("1b", "down"): (16, 512, 1, 8, 3), ("3b", "down"): (16, 512, 1, 8, 3)}),
    ("pdl all, down 1 warp 8 slices", ALL(P1), {("1b", "down"): (16, 512, 1, 8, 3),
                                                ("3b", "down"): (16, 512, 1, 8, 3)}),
    ("pdl all, down 4 slices", ALL(P1), {("1b", "down"): (16, 1024, 2, 4, 2), ("3b", "down"): (16, 1024, 2, 4, 2)}),
]
# --search: int8 configs tried in the engine for one role at a time (the table's row is the baseline), per model
CANDIDATES = {
    ("1b", "qkv"): [(8, 512, 1, 1, 3), (8, 512, 2, 1, 3), (8, 1024, 2, 1, 2), (8, 2048, 4, 1, 1), (16, 2048, 4, 1, 1),
                    (16, 512, 1, 1, 3)],
    ("3b", "qkv"): [(8, 512, 1, 1, 3), (8, 512, 2, 1, 3), (8, 1024, 2, 1, 3), (16, 1024, 2, 1, 3), (16, 1024, 4, 1, 3),
                    (16, 512, 1, 1, 4)],
    ("1b", "o"): [(4, 2048, 4, 1, 1), (8, 1024, 2, 2, 1), (8, 512, 1, 4, 1), (16, 512, 1, 4, 1), (16, 1024, 2, 2, 1),
                  (8, 512, 1, 1, 4)],
    ("3b", "o"): [(8, 1024, 2, 3, 1), (8, 512, 1, 3, 2), (8, 512, 1, 6, 1), (4, 512, 1, 1, 3), (16, 1024, 2, 3, 1),
                  (8, 1024, 2, 1, 3)],
    ("1b", "gate_up"): [(16, 512, 1, 1, 3), (32, 512, 1, 1, 3), (32, 1024, 2, 1, 2), (64, 512, 2, 1, 3),
                        (32, 512, 2, 1, 4), (32, 2048, 4, 1, 1)],
    ("3b", "gate_up"): [(16, 512, 1, 1, 3), (32, 512, 1, 1, 3), (32, 1024, 2, 1, 3), (64, 512, 2, 1, 3),
                        (32, 512, 2, 1, 4), (32, 512, 4, 1, 3)],
    ("1b", "down"): [(16, 512, 2, 4, 3), (16, 1024, 2, 8, 1), (16, 512, 2, 16, 1), (32, 512, 2, 8, 2),
                     (16, 2048, 4, 4, 1), (8, 1024, 2, 8, 1)],
    ("3b", "down"): [(16, 512, 2, 8, 2), (16, 1024, 2, 4, 2), (16, 512, 2, 4, 3), (16, 2048, 4, 4, 1),
                     (32, 2048, 4, 2, 2), (16, 2048, 4, 2, 3)],
}
SEARCH_MARGIN = 0.005  # a role's best candidate replaces the table's row when the step is this much faster
# --search, on the winners: the launch modes, as PDL_DEFAULT[8] would set them for every kernel
FINAL_MODES = {"prefetch 1 tile at start": PdlMode("none", 1), "prefetch 2 tiles at start": PdlMode("none", 2),
               "pdl all late": PdlMode("late", 0), "pdl all late, prefetch 1 tile": PdlMode("late", 1)}
PROFILED = ("plain", "pdl all, prefetch 1 tile", "pdl all but down, prefetch 1 tile", "pdl down only, no prefetch")


def role_of(name: str, args, cfg) -> str:
    """Which kernel of the step an accel.quant_ops call is (o and down share quant_linear_add: told by K)."""
    if name == "quant_qkv_rope":
        return "qkv"
    if name == "quant_norm_swiglu":
        return "gate_up"
    if name == "quant_norm_linear":
        return "lm_head" if args[2].shape[0] == cfg.vocab_size else "gate_up"
    return "down" if args[1].shape[1] == cfg.intermediate_size else "o"


OPS = ("quant_qkv_rope", "quant_norm_swiglu", "quant_norm_linear", "quant_linear_add")


@contextlib.contextmanager
def per_role(cfg, model: str, modes: dict, configs: dict):
    """Within: each role's kernel launches with modes.get(role) (None: plain), and the launch table has
    configs' rows for the roles' weights (by wrapping accel.quant_ops' ops and qgemv.qgemv_config)."""
    origs = {name: getattr(quant_ops, name) for name in OPS}
    own = dict(tuning.QGEMV)
    for (m, role), c in configs.items():  # int8's rows: one scale a row (group = K)
        if m == model:
            N, K, _ = shapes(cfg)[role]
            own[(N, K, 8, K) + (("rope",) if role == "qkv" else ())] = tuning.QGemvConfig(*c)

    def wrap(name):
        def op(*args):
            with decode_pdl(modes.get(role_of(name, args, cfg))):
                return origs[name](*args)
        return op

    orig_config = qgemv.qgemv_config

    def config(N, K, bits, group, sms, whole_rows=False, table=None):
        return orig_config(N, K, bits, group, sms, whole_rows, MappingProxyType(own) if table is None else table)

    for name in OPS:
        setattr(quant_ops, name, wrap(name))
    qgemv.qgemv_config = config
    try:
        yield
    finally:
        qgemv.qgemv_config = orig_config
        for name, f in origs.items():
            setattr(quant_ops, name, f)


def step_profile(engine: AccelEngine, steps: int = 16) -> list[dict]:
    """Per kernel position in a layer (a layer starts at the qkv kernel; the last layer's positions go on with the
    lm_head, the argmax and the next step's embedding):
    mean device µs and mean gap µs from the previous kernel's end, over `steps` greedy graph replays."""
    from torch.profiler import ProfilerActivity, profile
    prompt = prompt_ids(engine.config, 32)
    sess = engine.session(32 + steps + 24)
    logits = engine.prefill(prompt, sess)
    engine.decode_greedy(sess, logits, 32, 8)  # capture + warm-up
    torch.cuda.synchronize()
    logits = engine.prefill(prompt, sess)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.decode_greedy(sess, logits, 32, steps + 1)
        torch.cuda.synchronize()
    kern = sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and "Memcpy" not in e.name
                   and "Memset" not in e.name), key=lambda k: k[0])
    if not kern:  # the profiler saw no kernel inside the graph replays
        return []
    first = next((n for _, _, n in kern if "qkv" in n), kern[0][2])
    stats: dict[tuple, list] = {}
    layer, pos, prev_end = -1, 0, None
    for start, end, name in kern:
        if name == first:
            layer, pos = layer + 1, 0
        key = (pos, name[:48]) if layer >= 0 else (-1, name[:48])  # -1: before the first layer
        stats.setdefault(key, []).append((end - start, None if prev_end is None else start - prev_end))
        pos += 1
        prev_end = end
    rows = []
    for (pos, name), v in sorted(stats.items()):
        gaps = [g for _, g in v if g is not None]
        rows.append({"pos": pos, "kernel": name, "count": len(v), "us": statistics.mean(d for d, _ in v),
                     "gap_us": statistics.mean(gaps) if gaps else None})
    span = (kern[-1][1] - kern[0][0]) / (steps + 1)
    rows.append({"pos": None, "kernel": "span a step", "count": steps + 1, "us": span, "gap_us": None})
    return rows


def profile_within(cfg, weights, context, label: str) -> list[dict]:
    """`step_profile` of the bf16 engine over `weights` built and run inside `context`, printed under `label`."""
    with context:
        eng = AccelEngine(cfg, weights, torch.device("cuda"), "bf16")
        rows = step_profile(eng)
    del eng
    _print_profile(label, rows)
    return rows


def _print_profile(label: str, rows: list[dict]) -> None:
    print(f"-- {label}", flush=True)
    for r in rows:
        gap = "" if r["gap_us"] is None else f" gap {r['gap_us']:7.2f}"
        print(f"   {r['pos']!s:>4} {r['kernel']:<48} x{r['count']:<5} {r['us']:8.2f} us{gap}", flush=True)


def compare(model: str, specs: list[str], profile: bool) -> list[dict]:
    cfg = PRESETS[NAMES[model]]
    bf16_weights = random_weights(cfg, "cuda", torch.bfloat16, seed=0)
    bf16, _ = rate_within(cfg, bf16_weights, contextlib.nullcontext())
    rows = [{"model": model, "quant": "bf16", "variant": "plain", "decode_tok_s": bf16}]
    print(f"{model} bf16 {bf16:8.1f} tok/s", flush=True)
    if profile:
        rows[-1]["profile"] = profile_within(cfg, bf16_weights, contextlib.nullcontext(), f"{model} bf16")
    del bf16_weights
    for spec in specs:
        weights = quantize_weights(random_weights(cfg, "cuda", torch.bfloat16, seed=0), QuantSpec.parse(spec))
        first = None
        for name, modes, configs in VARIANTS:
            ctx = per_role(cfg, model, modes, configs)
            try:
                rate, tokens = rate_within(cfg, weights, ctx)
            except Exception as e:  # a variant that does not compile or launch is reported, not fatal
                print(f"{model} {spec} {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            first = tokens if first is None else first
            row = {"model": model, "quant": spec, "variant": name, "modes": {r: m and m._asdict()
                                                                             for r, m in modes.items()},
                   "configs": {r: c for (m, r), c in configs.items() if m == model}, "decode_tok_s": rate,
                   "x_bf16": rate / bf16, "tokens_equal_first": tokens == first}
            if profile and name in PROFILED:
                row["profile"] = profile_within(cfg, weights, per_role(cfg, model, modes, configs),
                                                f"{model} {spec} {name}")
            rows.append(row)
            print(f"{model} {spec:<8} {name:<40} {rate:8.1f} tok/s  {rate / bf16:5.3f}x bf16"
                  f"{'' if row['tokens_equal_first'] else '  TOKENS DIFFER'}", flush=True)
        del weights
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def search(model: str, spec: str = "int8") -> tuple[list[dict], dict]:
    """CANDIDATES in the engine under plain launches, one role at a time over the table's other rows; each role's
    fastest (by more than SEARCH_MARGIN) joins the winners; then the winners together, plain and in each
    FINAL_MODES launch mode. -> (rows, {role: config})."""
    cfg = PRESETS[NAMES[model]]
    bf16, _ = rate_within(cfg, random_weights(cfg, "cuda", torch.bfloat16, seed=0), contextlib.nullcontext())
    print(f"{model} bf16 {bf16:8.1f} tok/s", flush=True)
    rows = [{"model": model, "quant": "bf16", "variant": "plain", "decode_tok_s": bf16}]
    weights = quantize_weights(random_weights(cfg, "cuda", torch.bfloat16, seed=0), QuantSpec.parse(spec))

    def measure(name, modes, configs):
        try:
            rate, tokens = rate_within(cfg, weights, per_role(cfg, model, modes, configs))
        except Exception as e:  # a config that does not compile or launch is reported, not fatal
            print(f"{model} {spec} {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            return 0.0
        rows.append({"model": model, "quant": spec, "variant": name, "modes": {r: m and m._asdict()
                                                                               for r, m in modes.items()},
                     "configs": {r: c for (m, r), c in configs.items() if m == model}, "decode_tok_s": rate,
                     "x_bf16": rate / bf16, "tokens": tokens[:16]})
        print(f"{model} {spec:<8} {name:<44} {rate:8.1f} tok/s  {rate / bf16:5.3f}x bf16", flush=True)
        return rate

    base = measure("table", {}, {})
    winners = {}
    for role in ("qkv", "o", "gate_up", "down"):
        tried = [(measure(f"{role} {c}", {}, {(model, role): c}), c) for c in CANDIDATES[(model, role)]]
        rate, c = max(tried)
        if rate > base * (1 + SEARCH_MARGIN):
            winners[role] = c
    both = {(model, r): c for r, c in winners.items()}
    measure("table", {}, {})  # drift check: the baseline again
    measure("winners", {}, both)
    for name, mode in FINAL_MODES.items():
        measure(f"winners, {name}", ALL(mode), both)
    return rows, winners  # the quantized weights go with this frame


def main(argv=None):
    ap = bench_parser("tools.bench.quant_roles", __doc__)
    ap.set_defaults(specs="int8")
    ap.add_argument("--profile", action="store_true", help="per kernel of the graph replays (torch.profiler)")
    ap.add_argument("--search", action="store_true", help="int8: each role's CANDIDATES in the engine")
    args, models, specs, res = bench_args(ap, argv)
    t0 = time.time()
    for m in models:
        if args.search:
            rows, winners = search(m)
            res["rows"] += rows
            res.setdefault("winners", {})[m] = winners
            print(f"{m} winners {winners}", flush=True)
        else:
            res["rows"] += compare(m, specs, args.profile)
        with open(f"{args.out_dir}/quant_roles.json", "w") as f:
            json.dump(res, f, indent=1)
    print(f"total {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
