"""Quantized decode GEMV launch configs (accel/kernels/qgemv.py) per Llama 3.2 shape and format, on a CUDA GPU.

`python3 -m tools.bench.qgemv_sweep OUT_DIR [--models=1b,3b] [--quant=int8,int4:64]
[--gemvs=qkv,o,gate_up,down,lm_head] [--budget=S] [--focus]` (--focus: candidates() says which).
Each shape runs as the decode step runs it: qkv through the fused norm + qkv + RoPE + cache-write kernel
(qkv_rope_qfwd), o with the residual, gate_up and the lm_head with the norm prologue, down with SwiGLU and the
residual. Every candidate QGemvConfig is first checked against float64 "dequantize, then multiply" (bf16
tolerance; qkv: against the unfused GEMV + rope_kv_write), then timed: µs a call inside one CUDA graph over
>= 256 MB of weight copies (tools.bench.gemv_sweep.graph_us: the layers' weights do not stay in the 50 MB L2
during decode either). The rule's config (qgemv_config with an empty table) comes first, then the table's row (if
any), then variants around it; past --budget seconds the rest is skipped. Writes OUT_DIR/qgemv_sweep.json and
OUT_DIR/qgemv_table.txt (QGEMV's body with the rows whose winner beat today's config by > 2%): copy it into
accel/kernels/tuning.py by hand once the engine is measured with it, the numbers in NOTES.md (nothing here
rewrites a table).
"""
from __future__ import annotations

import json
import sys
import time

import torch
import triton

from accel.kernels.common import sm_count
from accel.kernels.qgemv import qgemv_config, qgemv_fwd
from accel.kernels.qgemv_fused import qkv_rope_qfwd
from accel.kernels.rope import rope_kv_write_fwd
from accel.kernels.tuning import QGEMV, QGemvConfig
from accel.ops.torch_ops import torch_rms_norm, torch_swiglu_gate_up
from accel.quant_ops import QuantTensor, quantize
from refimpl.model.config import PRESETS
from refimpl.quant.schemes import QuantSpec
from tools.bench.gemv_sweep import graph_us

NAMES = {"1b": "llama-3.2-1b", "3b": "llama-3.2-3b"}


def shapes(cfg) -> dict:
    D, F = cfg.hidden_size, cfg.intermediate_size
    return {"qkv": (cfg.q_size + 2 * cfg.kv_size, D, "rope"), "o": (D, cfg.q_size, "residual"),
            "gate_up": (2 * F, D, "norm"), "down": (D, F, "swiglu"), "lm_head": (cfg.vocab_size, D, "norm")}


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


class Case:
    """One shape and format: weight copies (>= 256 MB in all), inputs, and the float64 reference."""

    def __init__(self, what: str, N: int, K: int, fusion: str, spec: str, cfg, min_bytes: int = 256 * 2**20):
        g = torch.Generator(device="cuda").manual_seed(0)
        dev, dt = torch.device("cuda"), torch.bfloat16
        w = (torch.randn(N, K, device=dev, generator=g) * 0.02).to(dt)
        t = quantize(w, QuantSpec.parse(spec))
        del w
        self.what, self.fusion, self.t, self.N, self.K = what, fusion, t, N, K
        n = max(1, -(-min_bytes // t.nbytes))
        self.copies = [t] + [QuantTensor(t.fmt, t.bits, t.group, t.q.clone(), t.scale.clone(),
                                         None if t.low is None else t.low.clone(), t.K, t.offset)
                             for _ in range(n - 1)]
        self.x = torch.randn(1, 2 * K if fusion == "swiglu" else K, device=dev, generator=g).to(dt)
        self.r = torch.randn(1, N, device=dev, generator=g).to(dt)
        self.nw = (1 + 0.1 * torch.randn(K, device=dev, generator=g)).to(dt)
        if fusion == "rope":
            E, NKV = cfg.head_dim, cfg.num_key_value_heads
            S = 64
            self.pos = torch.tensor([5], device=dev)
            ang = torch.randn(S, E // 2, device=dev, generator=g)
            self.cos, self.sin = ang.cos(), ang.sin()
            self.ck = torch.zeros(NKV, S, E, device=dev, dtype=dt)
            self.cv = torch.zeros_like(self.ck)

    def call(self, t: QuantTensor, config, out=None):
        args = (t.q, t.scale, t.low, t.bits, t.offset, t.group, t.K, self.x)
        if self.fusion == "rope":
            return qkv_rope_qfwd(*args, self.nw, 1e-5, self.cos, self.sin, self.pos, self.ck, self.cv,
                                 config=config)
        if self.fusion == "norm":
            return qgemv_fwd(*args, norm_weight=self.nw, eps=1e-5, config=config, out=out)
        r = self.r.clone() if out is None else out
        return qgemv_fwd(*args, swiglu=self.fusion == "swiglu", residual=r, out=r, config=config)

    def check(self, config) -> float:
        """Max error over the max of the float64 reference (the caches' k/v slots too for qkv)."""
        t = self.t
        if self.fusion == "rope":
            got_q = self.call(t, config).float()
            got_kv = torch.cat([self.ck[:, 5], self.cv[:, 5]]).float()
            qkv = qgemv_fwd(t.q, t.scale, t.low, t.bits, t.offset, t.group, t.K, self.x, norm_weight=self.nw,
                            eps=1e-5)
            NKV, _, E = self.ck.shape
            H = self.N // E - 2 * NKV
            ck, cv = torch.zeros_like(self.ck), torch.zeros_like(self.cv)
            want_q = rope_kv_write_fwd(qkv[:, :H * E].view(1, H, E), qkv[:, H * E:(H + NKV) * E].view(1, NKV, E),
                                       qkv[:, (H + NKV) * E:].view(1, NKV, E), self.cos[5:6], self.sin[5:6], ck, cv,
                                       self.pos).float()
            want_kv = torch.cat([ck[:, 5], cv[:, 5]]).float()
            return max(((got_q - want_q).abs().max() / want_q.abs().max()).item(),
                       ((got_kv - want_kv).abs().max() / want_kv.abs().max()).item())
        fx = (torch_rms_norm(self.x, self.nw, 1e-5) if self.fusion == "norm"
              else torch_swiglu_gate_up(self.x) if self.fusion == "swiglu" else self.x)
        want = fx.double() @ t.dequantize().double().T + (self.r.double() if self.fusion != "norm" else 0)
        got = self.call(t, config).double()
        return ((got - want).abs().max() / want.abs().max()).item()

    def gate_up_swiglu_error(self, got: torch.Tensor) -> float:
        """got [1, F] (norm + gate_up + SwiGLU, self.fusion "norm") against norm, the dequantized GEMV in float64
        rounded to x's dtype (the unfused path's roundings), then SwiGLU: max error over the max of the reference."""
        gate_up = torch_rms_norm(self.x, self.nw, 1e-5).double() @ self.t.dequantize().double().T  # [1, 2F]
        want = torch_swiglu_gate_up(gate_up.to(self.x.dtype)).double()  # [1, F]
        return ((got.double() - want).abs().max() / want.abs().max()).item()

    def time_us(self, config, **call_kw) -> float:
        outs = [torch.empty(1, self.N, device="cuda", dtype=torch.bfloat16) for _ in self.copies]
        for o in outs:
            o.copy_(self.r)
        return graph_us([lambda t=t, o=o: self.call(t, config, o, **call_kw) for t, o in zip(self.copies, outs)])


MAX_REL_ERR = 2 ** -6  # a config whose result is further off is reported wrong, not timed


def timed_entry(case: Case, config, nbytes: int) -> dict:
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
    result = {"device": torch.cuda.get_device_name(), "triton": triton.__version__, "rows": []}
    for m in models:
        cfg = PRESETS[NAMES[m]]
        for what, (N, K, fusion) in shapes(cfg).items():
            if gemvs and what not in gemvs:
                continue
            for spec in specs:
                case = Case(what, N, K, fusion, spec, cfg)
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
                if path:  # after every row: a run cut short keeps what it measured
                    with open(path, "w") as f:
                        json.dump(result, f, indent=1)
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
    names = {(N, K): f"{m.upper()} {what}" for m in NAMES for what, (N, K, _) in shapes(PRESETS[NAMES[m]]).items()}
    lines, seen = [], set()
    for key, c in table.items():
        name = names.get(key[:2]) if key[:2] not in seen else None
        seen.add(key[:2])
        c = tuple(c) if c.programs else tuple(c)[:5]  # programs 0 (one a row block): the field's default
        lines.append(f"    {key!r}: QGemvConfig{c!r},{'  # ' + name if name else ''}".replace("'", '"'))
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    out_dir = argv[0]
    opts = dict(a[2:].split("=", 1) if "=" in a else (a[2:], "") for a in argv[1:] if a.startswith("--"))
    models = opts.get("models", "1b,3b").split(",")
    specs = opts.get("quant", "int8,int4:64").split(",")
    gemvs = opts["gemvs"].split(",") if "gemvs" in opts else None
    result = sweep(models, specs, float(opts.get("budget", "1e9")), f"{out_dir}/qgemv_sweep.json", gemvs,
                   "focus" in opts)
    with open(f"{out_dir}/qgemv_table.txt", "w") as f:
        f.write(table_source(result, sm_count(torch.device("cuda"))) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
