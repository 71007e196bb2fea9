"""The quantized decode step's launch modes (accel.kernels.qgemv.PdlMode: programmatic dependent launch with an L2
prefetch of each program's weights) in the engine, beside bf16, one process, the same weights (tools/bench/NOTES.md).

`python3 -m tools.bench.quant_pdl [OUT_DIR] [--models=1b,3b] [--specs=int8,int4:64] [--roles] [--once] [--warm]`:
for each model the bf16 engine's greedy decode tok/s (tools.bench.gpu.decode_rate: 32-token prompt, 256 tokens,
median of 3), then for each format every VARIANTS row twice (forward, then reversed order: drift shows as a gap
between the two; --once: forward only), with the greedy tokens checked equal to the plain launch's. --roles:
ROLE_VARIANTS instead, PDL for one kernel of the step at a time. --warm: only build each variant and decode a few
tokens (fills Triton's cache; several such processes may compile in parallel before the timed one).
Writes OUT_DIR/quant_pdl.json (quant_pdl_roles.json with --roles).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import time

import torch

from accel.engine import AccelEngine
from accel.kernels.qgemv import PdlMode
from accel import quant_ops
from accel.kernels.tuning import Tuning
from accel.quant_layers import quantize_weights
from accel.quant_ops import decode_pdl, swiglu_in_gate_up
from accel.weights import random_weights
from refimpl.model.config import PRESETS
from refimpl.errors import Llama32Error
from refimpl.quant.formats import QuantSpec
from tools.bench.decode_variants import NAMES, run_record
from tools.bench.gpu import decode_rate
from tools.bench.timing import require_cuda

# (name, the quantized kernels' mode, the decode attention's launch options, the one kernel it applies to or None)
VARIANTS = [("plain", None, {}, None), ("pdl, no prefetch", PdlMode("wait", 0), {}, None),
            ("pdl, prefetch 1 tile", PdlMode("wait", 1), {}, None),
            ("pdl, prefetch all", PdlMode("wait", 64), {}, None),
            ("pdl late trigger, prefetch 1 tile", PdlMode("late", 1), {}, None),
            ("pdl + attention pdl", PdlMode("wait", 1), {"config": {"PDL": True}}, None)]
# the accel.quant_ops op each kernel of the step goes through (gate_up and the lm_head share one: told by N)
ROLES = {"qkv": "quant_qkv_rope", "o": "quant_linear_add", "gate_up": "quant_norm_linear",
         "down": "quant_swiglu_linear_add", "lm_head": "quant_norm_linear"}
ROLE_VARIANTS = [("plain", None, {}, None), ("pdl, prefetch 1 tile", PdlMode("wait", 1), {}, None)] + [
    (f"pdl {role} only, prefetch 1 tile", PdlMode("wait", 1), {}, role) for role in ROLES]


@contextlib.contextmanager
def pdl_only(role: str | None, mode, vocab: int):
    """`mode` for the step's `role` kernel and plain launches for the rest (role None: `mode` for all), by
    wrapping the accel.quant_ops op that accel.ops.fused calls for it. The step as this study measured it: the
    SwiGLU in down's prologue (ROLES' ops; swiglu_in_gate_up)."""
    with swiglu_in_gate_up(False):
        with _pdl_only(role, mode, vocab):
            yield


@contextlib.contextmanager
def _pdl_only(role: str | None, mode, vocab: int):
    if role is None:
        with decode_pdl(mode):
            yield
        return
    name = ROLES[role]
    orig = getattr(quant_ops, name)

    def op(*args):
        w = args[2] if name in ("quant_norm_linear", "quant_qkv_rope") else args[1]
        hit = role not in ("gate_up", "lm_head") or (w.shape[0] == vocab) == (role == "lm_head")
        with decode_pdl(mode if hit else None):
            return orig(*args)
    setattr(quant_ops, name, op)
    try:
        with decode_pdl(None):
            yield
    finally:
        setattr(quant_ops, name, orig)


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


def _rate(cfg, weights, mode, attention: dict, warm: bool, role: str | None = None) -> tuple[float, list[int]]:
    return rate_within(cfg, weights, pdl_only(role, mode, cfg.vocab_size), Tuning(decode_attention=attention), warm)


def compare(model: str, specs: list[str], warm: bool = False, variants=VARIANTS, once: bool = False) -> list[dict]:
    cfg = PRESETS[NAMES[model]]
    bf16, _ = _rate(cfg, random_weights(cfg, "cuda", torch.bfloat16, seed=0), None, {}, warm)
    rows = [{"model": model, "quant": "bf16", "variant": "plain", "decode_tok_s": bf16}]
    print(f"{model} bf16 {bf16:8.1f} tok/s", flush=True)
    for spec in specs:
        weights = quantize_weights(random_weights(cfg, "cuda", torch.bfloat16, seed=0), QuantSpec.parse(spec))
        plain_tokens = None
        for order in (variants, variants[::-1])[:1 if warm or once else 2]:
            for name, mode, attention, role in order:
                rate, tokens = _rate(cfg, weights, mode, attention, warm, role)
                plain_tokens = tokens if mode is None else plain_tokens
                row = {"model": model, "quant": spec, "variant": name, "mode": mode and mode._asdict(),
                       "attention": attention, "decode_tok_s": rate, "x_bf16": rate / bf16, "tokens": tokens[:16]}
                rows.append(row)
                print(f"{model} {spec:<8} {name:<36} {rate:8.1f} tok/s  {rate / bf16:5.3f}x bf16", flush=True)
        for r in rows:
            if r["quant"] == spec:
                r["tokens_equal_plain"] = r["tokens"] == plain_tokens[:16]
        del weights
        gc.collect()
        torch.cuda.empty_cache()
    return rows


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
    ap = bench_parser("tools.bench.quant_pdl", __doc__)
    ap.add_argument("--roles", action="store_true", help="PDL for one kernel of the step at a time (ROLE_VARIANTS)")
    ap.add_argument("--once", action="store_true", help="each variant once (forward order only)")
    ap.add_argument("--warm", action="store_true", help="only build each variant and decode a few tokens")
    args, models, specs, res = bench_args(ap, argv)
    t0 = time.time()
    for m in models:
        res["rows"] += compare(m, specs, args.warm, ROLE_VARIANTS if args.roles else VARIANTS, args.once)
        if not args.warm:  # after each model: a run cut short keeps what it measured
            with open(f"{args.out_dir}/quant_pdl{'_roles' if args.roles else ''}.json", "w") as f:
                json.dump(res, f, indent=1)
    print(f"total {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
