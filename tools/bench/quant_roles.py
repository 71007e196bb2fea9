"""The quantized decode step in the engine, kernel by kernel: a launch mode (accel.kernels.qgemv.PdlMode or plain)
and a launch config per role of the step (qkv + RoPE, o, gate_up + SwiGLU, down, lm_head), beside bf16, one
process, the same weights; and where the step's time goes inside the replayed CUDA graph (tools/bench/NOTES.md:
"Quantized decode step with programmatic dependent launch", "int8 decode speed").

`python3 -m tools.bench.quant_roles [OUT_DIR] [--models=1b,3b] [--specs=int8] [--set=roles|modes|one-role]
[--reverse] [--swiglu-in-down] [--warm] [--profile | --search]`: for each model the bf16 engine's greedy decode
tok/s, then for each format every variant of the set (rate_within: 32-token prompt, 256 tokens, median of 3; the
greedy tokens checked equal to the first variant's):
  roles     VARIANTS (the default): a mode and a config per role;
  modes     MODES: one mode for every kernel (and the decode attention PDL-launched);
  one-role  ONE_ROLE: PDL with a 1-tile prefetch on one kernel of the step at a time.
--reverse: the set again in reverse order (drift shows as a gap between the two passes). --swiglu-in-down: the MLP
with the SwiGLU in down's prologue (accel.quant_ops.swiglu_in_gate_up(False)), the step the launch modes were first
measured on. --warm: only build each variant and decode 4 tokens (fills Triton's cache). --profile: per kernel of
the graph replays (torch.profiler, 16 greedy steps): mean device time and the gap from the previous kernel's end
(< 0: overlap under PDL), per position in a layer, for bf16 and each format under PROFILED's variants. --search
(int8): `search`, each role's CANDIDATES in the engine; the winners are printed and written, not put in any table.
Writes OUT_DIR/quant_roles.json (quant_roles_modes.json, quant_roles_one-role.json) after each model.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import time
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping, NamedTuple

import torch

from accel import quant_ops
from accel.engine import AccelEngine
from accel.kernels import qgemv, tuning
from accel.kernels.qgemv import PdlMode
from accel.kernels.tuning import Tuning
from accel.quant_layers import quantize_weights
from accel.quant_ops import decode_pdl, swiglu_in_gate_up
from accel.weights import random_weights
from refimpl.errors import Llama32Error
from refimpl.model.config import PRESETS
from refimpl.quant.schemes import QuantSpec
from tools.bench.decode_variants import NAMES, run_record
from tools.bench.gpu import decode_rate, prompt_ids
from tools.bench.qgemv_sweep import shapes
from tools.bench.timing import require_cuda

ROLES = ("qkv", "o", "gate_up", "down", "lm_head")
NO_ENTRIES: Mapping = MappingProxyType({})


class Variant(NamedTuple):
    name: str
    modes: Mapping[str, PdlMode | None]  # {role: mode}; a role missing: plain launches
    configs: Mapping[tuple[str, str], tuple] = NO_ENTRIES  # {(model, role): a QGemvConfig tuple for its weight}
    attention: Mapping[str, object] = NO_ENTRIES  # the decode attention's launch options (Tuning.decode_attention)


P1, P0 = PdlMode("wait", 1), PdlMode("wait", 0)
ALL = lambda mode, **but: {r: but.get(r, mode) for r in ROLES}  # noqa: E731
DOWN_1_WARP = {("1b", "down"): (16, 512, 1, 8, 3), ("3b", "down"): (16, 512, 1, 8, 3)}
VARIANTS = [
    Variant("plain", {}),
    Variant("pdl all, prefetch 1 tile", ALL(P1)),
    Variant("pdl all, no prefetch", ALL(P0)),
    Variant("pdl all but down, prefetch 1 tile", ALL(P1, down=None)),
    Variant("pdl all but down, no prefetch", ALL(P0, down=None)),
    Variant("pdl down only, no prefetch", {"down": P0}),
    Variant("pdl all, down late trigger", ALL(P1, down=PdlMode("late", 0))),
    Variant("pdl all late, no prefetch", ALL(PdlMode("late", 0))),
    Variant("plain, down 1 warp 8 slices", {}, DOWN_1_WARP),
    Variant("pdl all, down 1 warp 8 slices", ALL(P1), DOWN_1_WARP),
    Variant("pdl all, down 4 slices", ALL(P1), {("1b", "down"): (16, 1024, 2, 4, 2),
                                                ("3b", "down"): (16, 1024, 2, 4, 2)}),
]
MODES = [Variant("plain", {}), Variant("pdl, no prefetch", ALL(P0)), Variant("pdl, prefetch 1 tile", ALL(P1)),
         Variant("pdl, prefetch all", ALL(PdlMode("wait", 64))),
         Variant("pdl late trigger, prefetch 1 tile", ALL(PdlMode("late", 1))),
         Variant("pdl + attention pdl", ALL(P1), attention={"config": {"PDL": True}})]
ONE_ROLE = [Variant("plain", {}), Variant("pdl, prefetch 1 tile", ALL(P1))] + [
    Variant(f"pdl {role} only, prefetch 1 tile", {role: P1}) for role in ROLES]
SETS = {"roles": VARIANTS, "modes": MODES, "one-role": ONE_ROLE}
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


def role_of(w, cfg) -> str:
    """Which kernel of the step multiplies by the matrix w, by its shape [N, K] (o and down share an op, and so do
    the lm_head and gate_up's norm GEMV with the SwiGLU in down)."""
    N, K = w.shape
    if N == cfg.vocab_size:
        return "lm_head"
    if N == cfg.q_size + 2 * cfg.kv_size:
        return "qkv"
    if N == 2 * cfg.intermediate_size:
        return "gate_up"
    return "down" if K == cfg.intermediate_size else "o"


# the accel.quant_ops ops of the step, and where each takes its weight
OPS = {"quant_qkv_rope": 2, "quant_norm_swiglu": 2, "quant_norm_linear": 2, "quant_linear_add": 1,
       "quant_swiglu_linear_add": 1}


@contextlib.contextmanager
def per_role(cfg, model: str, modes: Mapping, configs: Mapping, gate_up_swiglu: bool = True):
    """Within: the decode MLP's SwiGLU in gate_up's epilogue (gate_up_swiglu) or in down's prologue, each role's
    kernel launches with modes.get(role) (None: plain; so does any other quantized launch), and the launch table
    has configs' rows for the roles' weights (by wrapping accel.quant_ops' ops and qgemv.qgemv_config)."""
    origs = {name: getattr(quant_ops, name) for name in OPS}
    own = dict(tuning.QGEMV)
    for (m, role), c in configs.items():  # int8's rows: one scale a row (group = K)
        if m == model:
            N, K, _ = shapes(cfg)[role]
            own[(N, K, 8, K) + (("rope",) if role == "qkv" else ())] = tuning.QGemvConfig(*c)

    def wrap(name):
        def op(*args):
            with decode_pdl(modes.get(role_of(args[OPS[name]], cfg))):
                return origs[name](*args)
        return op

    orig_config = qgemv.qgemv_config

    def config(N, K, bits, group, sms, whole_rows=False, table=None):
        return orig_config(N, K, bits, group, sms, whole_rows, MappingProxyType(own) if table is None else table)

    for name in OPS:
        setattr(quant_ops, name, wrap(name))
    qgemv.qgemv_config = config
    try:
        with swiglu_in_gate_up(gate_up_swiglu), decode_pdl(None):
            yield
    finally:
        qgemv.qgemv_config = orig_config
        for name, f in origs.items():
            setattr(quant_ops, name, f)


def quant_random_weights(cfg, spec: str):
    """The benchmarks' weights: random bf16 weights at cfg's shapes (seed 0), quantized on the GPU to `spec`."""
    return quantize_weights(random_weights(cfg, "cuda", torch.bfloat16, seed=0), QuantSpec.parse(spec))


def rate_within(cfg, weights, context, tuning: Tuning | None = None, warm: bool = False) -> tuple[float, list[int]]:
    """The bf16 engine over `weights` built and timed inside `context` (the capture records the launches chosen
    there): greedy decode tok/s (32-token prompt, 256 tokens, median of 3; warm: 4 tokens once) and the tokens."""
    with context:
        eng = AccelEngine(cfg, weights, torch.device("cuda"), "bf16", tuning=tuning or Tuning())
        rate, _, tokens = decode_rate(eng, 32, 4 if warm else 256, reps=1 if warm else 3)
    del eng
    gc.collect()
    torch.cuda.empty_cache()
    return rate, tokens


@dataclass
class Runs:
    """One model's quantized weights under variant after variant: a row each into `rows`, its greedy tokens
    checked against the first variant's."""
    cfg: object
    model: str
    spec: str
    weights: object
    bf16: float  # tok/s of the bf16 engine in this process
    gate_up_swiglu: bool = True
    warm: bool = False
    rows: list[dict] = field(default_factory=list)
    first: list[int] | None = None

    def within(self, v: Variant):
        return per_role(self.cfg, self.model, v.modes, v.configs, self.gate_up_swiglu)

    def measure(self, v: Variant) -> float:
        """v's decode tok/s (0.0 where it does not compile or launch: reported, not fatal)."""
        try:
            rate, tokens = rate_within(self.cfg, self.weights, self.within(v), Tuning(decode_attention=v.attention),
                                       self.warm)
        except Exception as e:
            print(f"{self.model} {self.spec} {v.name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            return 0.0
        self.first = tokens if self.first is None else self.first
        self.rows.append({"model": self.model, "quant": self.spec, "variant": v.name,
                          "modes": {r: m and m._asdict() for r, m in v.modes.items()},
                          "configs": {r: c for (m, r), c in v.configs.items() if m == self.model},
                          "attention": dict(v.attention),
                          "decode_tok_s": rate, "x_bf16": rate / self.bf16, "tokens": tokens[:16],
                          "tokens_equal_first": tokens == self.first})
        print(f"{self.model} {self.spec:<8} {v.name:<44} {rate:8.1f} tok/s  {rate / self.bf16:5.3f}x bf16"
              f"{'' if tokens == self.first else '  TOKENS DIFFER'}", flush=True)
        return rate

    def profile(self, v: Variant) -> None:
        """step_profile of v into its last row."""
        self.rows[-1]["profile"] = profile_within(self.cfg, self.weights, self.within(v),
                                                  f"{self.model} {self.spec} {v.name}")


def bf16_rate(cfg, model: str, warm: bool = False, profile: bool = False) -> dict:
    """The bf16 engine's row (tok/s, and with `profile` its step_profile)."""
    weights = random_weights(cfg, "cuda", torch.bfloat16, seed=0)
    rate, _ = rate_within(cfg, weights, contextlib.nullcontext(), warm=warm)
    row = {"model": model, "quant": "bf16", "variant": "plain", "decode_tok_s": rate}
    print(f"{model} bf16 {rate:8.1f} tok/s", flush=True)
    if profile:
        row["profile"] = profile_within(cfg, weights, contextlib.nullcontext(), f"{model} bf16")
    return row


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


def compare(model: str, specs: list[str], variants: list[Variant] = VARIANTS, profile: bool = False,
            reverse: bool = False, gate_up_swiglu: bool = True, warm: bool = False) -> list[dict]:
    cfg = PRESETS[NAMES[model]]
    rows = [bf16_rate(cfg, model, warm, profile)]
    for spec in specs:
        weights = quant_random_weights(cfg, spec)
        runs = Runs(cfg, model, spec, weights, rows[0]["decode_tok_s"], gate_up_swiglu, warm)
        for v in variants + (variants[::-1] if reverse and not warm else []):
            if runs.measure(v) and profile and v.name in PROFILED:
                runs.profile(v)
        rows += runs.rows
        del weights, runs
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def search(model: str, spec: str = "int8") -> tuple[list[dict], dict]:
    """CANDIDATES in the engine under plain launches, one role at a time over the table's other rows; each role's
    fastest (by more than SEARCH_MARGIN) joins the winners; then the winners together, plain and in each
    FINAL_MODES launch mode. -> (rows, {role: config})."""
    cfg = PRESETS[NAMES[model]]
    bf16 = bf16_rate(cfg, model)
    weights = quant_random_weights(cfg, spec)
    runs = Runs(cfg, model, spec, weights, bf16["decode_tok_s"])
    base = runs.measure(Variant("table", {}))
    winners = {}
    for role in ("qkv", "o", "gate_up", "down"):
        tried = [(runs.measure(Variant(f"{role} {c}", {}, {(model, role): c})), c) for c in CANDIDATES[(model, role)]]
        rate, c = max(tried)
        if rate > base * (1 + SEARCH_MARGIN):
            winners[role] = c
    both = {(model, r): c for r, c in winners.items()}
    runs.measure(Variant("table", {}))  # drift check: the baseline again
    runs.measure(Variant("winners", {}, both))
    for name, mode in FINAL_MODES.items():
        runs.measure(Variant(f"winners, {name}", ALL(mode), both))
    return [bf16] + runs.rows, winners  # the quantized weights go with this frame


def bench_parser(script: str, doc: str, specs: str = "int8,int4:64",
                 flag: str = "--specs") -> argparse.ArgumentParser:
    """The arguments the quantized decode benchmarks share: [OUT_DIR] [--models=1b,3b] [--specs=int8,int4:64]
    (`flag` names the formats' option, e.g. qgemv_probe's --quant; args.specs either way)."""
    ap = argparse.ArgumentParser(prog=f"python3 -m {script}", description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir", nargs="?", default=".", help="where the JSON results go (default: .)")
    ap.add_argument("--models", default="1b,3b", help=f"comma-separated, of {', '.join(NAMES)} (default: %(default)s)")
    ap.add_argument(flag, dest="specs", default=specs, help="formats, comma-separated (default: %(default)s)")
    ap.set_defaults(specs_flag=flag)
    return ap


def bench_args(ap: argparse.ArgumentParser, argv=None) -> tuple[argparse.Namespace, list[str], list[str], dict]:
    """Parsed arguments (--help answers without a GPU), then the CUDA check -> (args, models, specs, results
    record)."""
    args = ap.parse_args(argv)
    models, specs = args.models.split(","), args.specs.split(",")
    if any(m not in NAMES for m in models):
        ap.error(f"--models {args.models}: expected names of {', '.join(NAMES)}")
    try:
        [QuantSpec.parse(s) for s in specs]
    except Llama32Error as e:
        ap.error(f"{args.specs_flag}: {e}")
    require_cuda(ap.prog)
    return args, models, specs, run_record(rows=[])


def main(argv=None):
    ap = bench_parser("tools.bench.quant_roles", __doc__, specs="int8")
    ap.add_argument("--set", dest="variants", choices=tuple(SETS), default="roles",
                    help="the variants (module doc; default: %(default)s)")
    ap.add_argument("--reverse", action="store_true", help="the variants again in reverse order")
    ap.add_argument("--swiglu-in-down", action="store_true", help="the MLP's SwiGLU in down's prologue (the old step)")
    ap.add_argument("--warm", action="store_true", help="only build each variant and decode a few tokens")
    how = ap.add_mutually_exclusive_group()
    how.add_argument("--profile", action="store_true", help="per kernel of the graph replays (torch.profiler)")
    how.add_argument("--search", action="store_true", help="int8: each role's CANDIDATES in the engine")
    args, models, specs, res = bench_args(ap, argv)
    res.update(variants=args.variants, swiglu_in_gate_up=not args.swiglu_in_down)
    out = f"{args.out_dir}/quant_roles{'' if args.variants == 'roles' else '_' + args.variants}.json"
    t0 = time.time()
    for m in models:
        if args.search:
            rows, winners = search(m)
            res["rows"] += rows
            res.setdefault("winners", {})[m] = winners
            print(f"{m} winners {winners}", flush=True)
        else:
            res["rows"] += compare(m, specs, SETS[args.variants], args.profile, args.reverse,
                                   not args.swiglu_in_down, args.warm)
        if not args.warm:  # after each model: a run cut short keeps what it measured
            with open(out, "w") as f:
                json.dump(res, f, indent=1)
    print(f"total {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
