"""Quantized decode GEMV launch configs (accel/kernels/qgemv.py) per Llama 3.2 shape and format, on a CUDA GPU:
the sweep that regenerates accel/kernels/tuning.py's QGEMV table.

    python3 -m tools.bench.sweeps.qgemv OUT_DIR [--models 1b,3b] [--quant int8,int4:64]
        [--gemvs qkv,o,gate_up,down,lm_head] [--budget S] [--focus]

Each shape runs as the decode step runs it: qkv through the fused norm + qkv + RoPE + cache-write kernel
(qkv_rope_qfwd), o with the residual, gate_up and the lm_head with the norm prologue, down with SwiGLU and the
residual. Every candidate QGemvConfig is first checked against float64 "dequantize, then multiply" (bf16
tolerance; qkv: against the unfused GEMV + rope_kv_write), then timed: µs a call inside one CUDA graph over
>= 256 MB of weight copies (common.graph_us: the layers' weights do not stay in the L2 during decode either). The
rule's config (qgemv_config with an empty table) comes first, then the table's row (if any), then variants around
it; past --budget seconds the rest is skipped. Writes OUT_DIR/qgemv_sweep.json and OUT_DIR/qgemv_table.txt (QGEMV's
body with the rows whose winner beat today's config by > 2%): copy it into accel/kernels/tuning.py by hand once
the engine is measured with it (`llama32 bench --quant ...`), the numbers in docs/performance.md. Nothing here
rewrites a table.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import triton

from accel.kernels.common import sm_count
from accel.kernels.qgemv import qgemv_config
from accel.kernels.tuning import QGEMV, QGemvConfig
from refimpl.quant.schemes import QuantSpec
from tools.bench.common import (MODELS, decode_gemv_shapes, model_config, parser, record, require_cuda,
                                write_record)
from tools.bench.quant_gpu import MAX_REL_ERR, QuantGemvCase


def candidates(N: int, K: int, bits: int, group: int, sms: int, rope: bool, focus: bool = False) -> list[QGemvConfig]:
    """The rule's config, the table's, then variants: one or two warps over whole-row (or 2 / 4-tile) K slices
    through a 2-4 stage cp.async pipeline (the fastest family so far), then (unless focus) half / double the rows,
    narrower / wider tiles, 2 / 8 warps, K slices of 2 or 4 tiles."""
    rule = qgemv_config(N, K, bits, group, sms, rope, table={})
    out = [rule]
    table = qgemv_config(N, K, bits, group, sms, rope)
    if table != rule:
        out.append(table)
    kbytes = triton.next_power_of_2(triton.cdiv(K * bits, 8))

    def add(bn, nbytes, warps, per_slice=1, stages=None):
        """per_slice: tiles a K slice (0: the whole row); stages: None picks 1, 2 or 3 by per_slice."""
        if nbytes > max(kbytes, 512) or bn < 2 or (rope and bn // 2 > 64):
            return
        bk = nbytes * 8 // bits
        tiles = triton.cdiv(K, bk)
        per_slice = per_slice or tiles
        split = 1 if rope else triton.cdiv(tiles, per_slice)
        if stages is None:
            stages = 1 if per_slice == 1 and not rope else 2 + (per_slice > 2)
        c = QGemvConfig(bn, bk, warps, split, stages)
        if c not in out:
            out.append(c)

    for st in (3, 4, 2):
        add(16, 512, 1, 0, st)  # one warp, 16 rows a thread, the whole row through the pipeline
    add(8, 512, 1, 0, 3)
    add(16, 1024, 1, 0, 3)
    add(16, 512, 1, 4, 3)
    add(16, 512, 1, 2, 3)
    add(16, 512, 2, 0, 3)
    add(32, 512, 2, 0, 3)
    add(32, 512, 1, 0, 3)  # 32 rows: f(x)'s fixed point (per column, per thread) shared by twice the rows
    add(32, 1024, 2, 0, 3)
    add(32, 512, 1, 4, 3)
    add(32, 1024, 2, 2, 3)
    if focus:
        return out
    nb = rule.block_k * bits // 8
    add(rule.block_n * 2, nb, rule.warps)
    add(rule.block_n // 2, nb, rule.warps)
    add(rule.block_n, nb // 2, rule.warps)
    add(rule.block_n, nb, 8)
    add(rule.block_n * 2, nb // 2, max(1, nb // 1024))
    add(rule.block_n, nb, 2)
    add(rule.block_n * 4, nb, rule.warps)
    add(rule.block_n, nb, rule.warps, 2)
    add(rule.block_n, nb // 2, rule.warps, 4)
    add(rule.block_n * 2, nb // 2, 8)
    add(16, 512, 1, 3)
    add(16, 512, 2, 2)
    add(8, 1024, 2, 2)
    add(32, 512, 2, 1)
    return out


def timed_entry(case: QuantGemvCase, config, nbytes: int) -> dict:
    """One config of a case: checked (a NaN error counts as wrong), then timed -> its entry for the results."""
    entry = {"config": list(config)}
    try:
        entry["rel_err"] = case.check(config)
        if not entry["rel_err"] <= MAX_REL_ERR:
            entry["error"] = "wrong result"
        else:
            entry["us"] = case.time_us(config)
            entry["tb_s"] = nbytes / (entry["us"] * 1e-6) / 1e12
    except Exception as e:  # a config that does not compile or launch is reported, not fatal
        entry["error"] = f"{type(e).__name__}: {str(e)[:200]}"
    return entry


def sweep(models: list[str], specs: list[str], budget: float, path: str | None = None,
          gemvs: list[str] | None = None, focus: bool = False) -> dict:
    deadline = time.time() + budget
    sms = sm_count(torch.device("cuda"))
    result = record(rows=[])
    for m in models:
        cfg = model_config(m)
        for what, (N, K, fusion) in decode_gemv_shapes(cfg).items():
            if gemvs and what not in gemvs:
                continue
            for spec in specs:
                case = QuantGemvCase(what, N, K, fusion, spec, cfg)
                t = case.t
                row = {"model": m, "gemv": what, "N": N, "K": K, "quant": spec, "bits": t.bits, "group": t.group,
                       "bytes": t.nbytes, "configs": []}
                for c in candidates(N, K, t.bits, t.group, sms, fusion == "rope", focus):
                    if time.time() > deadline and row["configs"]:
                        break
                    row["configs"].append(timed_entry(case, c, t.nbytes))
                timed = [e for e in row["configs"] if "us" in e]
                if timed:
                    best = min(timed, key=lambda e: e["us"])
                    row["best"], row["rule_us"] = best, row["configs"][0].get("us")
                    print(f"{m} {what:<8}{spec:<8} rule {row['rule_us'] or float('nan'):8.2f} µs   best "
                          f"{best['us']:8.2f} µs ({best['tb_s']:.2f} TB/s) {best['config']}", flush=True)
                result["rows"].append(row)
                write_record(path, result)  # after every row: a run cut short keeps what it measured
                del case
                torch.cuda.empty_cache()
    return result


def table_source(result: dict, sms: int, margin: float = 0.02) -> str:
    """tuning.QGEMV's body with each swept row's fastest config where it beat the config the table gives now (its
    row, else the rule; both timed in this sweep) by more than `margin`; other rows kept. To paste by hand."""
    table = dict(QGEMV)
    for row in result["rows"]:
        key = (row["N"], row["K"], row["bits"], row["group"]) + (("rope",) if row["gemv"] == "qkv" else ())
        timed = {tuple(e["config"]): e["us"] for e in row["configs"] if "us" in e}
        now = timed.get(tuple(qgemv_config(*key[:4], sms, len(key) > 4)))
        if "best" in row and now is not None and row["best"]["us"] < (1 - margin) * now:
            table[key] = QGemvConfig(*row["best"]["config"])
    names = {(N, K): f"{m.upper()} {what}"
             for m in MODELS for what, (N, K, _) in decode_gemv_shapes(model_config(m)).items()}
    lines, seen = [], set()
    for key, c in table.items():
        name = names.get(key[:2]) if key[:2] not in seen else None
        seen.add(key[:2])
        c = tuple(c) if c.programs else tuple(c)[:5]  # programs 0 (one a row block): the field's default
        lines.append(f"    {key!r}: QGemvConfig{c!r},{'  # ' + name if name else ''}".replace("'", '"'))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = parser("tools.bench.sweeps.qgemv", __doc__, models="1b,3b", json_out=False)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--quant", type=quant_specs, default=quant_specs("int8,int4:64"), help="comma-separated formats")
    ap.add_argument("--gemvs", default=None, help="comma-separated, of qkv, o, gate_up, down, lm_head (default all)")
    ap.add_argument("--budget", type=float, default=1e9, help="seconds; past them only each shape's first configs")
    ap.add_argument("--focus", action="store_true", help="only the whole-row pipelined family (candidates())")
    args = ap.parse_args(argv)
    require_cuda("python3 -m tools.bench.sweeps.qgemv")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    result = sweep(args.models, args.quant, args.budget, args.out_dir / "qgemv_sweep.json",
                   args.gemvs.split(",") if args.gemvs else None, args.focus)
    (args.out_dir / "qgemv_table.txt").write_text(table_source(result, sm_count(torch.device("cuda"))) + "\n")


def quant_specs(text: str) -> list[str]:
    """'int8,int4:64' -> the formats, each checked by QuantSpec.parse (an argparse error otherwise)."""
    try:
        return [str(QuantSpec.parse(s.strip())) for s in text.split(",") if s.strip()]
    except Exception as e:
        raise argparse.ArgumentTypeError(f"--quant {text}: {e}") from None


if __name__ == "__main__":
    main()
