"""Measurements for `llama32 bench --quant`: weight-only quantized decode and prefill beside bf16, in one run.

For each model: random bf16 weights at the real shapes (seed 0); the bf16 engine is timed, then the same weights
quantized on the device (accel.quant_layers.quantize_weights) for every format, each timed the same way
(tools.bench.common.decode_rate); then every engine's prefill, the engines called in turn (as called, the host's
time to queue one, GPU time alone). Ratios are to the bf16 row. Also each decode GEMV alone (gemv_bench), bf16
vs quantized, at the model's shapes, each as its engine's step runs it.
"""
from __future__ import annotations

import gc

import torch

from accel.engine import AccelEngine
from accel.kernels.gemv import gemv_fwd
from accel.kernels.qgemv import qgemv_fwd
from accel.kernels.qgemv_fused import qkv_rope_qfwd
from accel.kernels.qkv_rope import qkv_rope_fwd
from accel.kernels.rope import rope_kv_write_fwd
from accel.ops.torch_ops import torch_rms_norm, torch_swiglu_gate_up
from accel.quant_layers import quantize_weights
from accel.quant_ops import QuantTensor, quantize
from accel.weights import random_weights
from refimpl.model.config import LlamaConfig
from refimpl.quant.schemes import QuantSpec
from tools.bench.common import decode_gemv_shapes, decode_rate, graph_us, prefill_call, prefill_gpu_ms, round_robin_ms


def _row(label: str, engine: AccelEngine, new_tokens: int, copy_tb_s: float | None) -> dict:
    rate, _, tokens = decode_rate(engine, 32, new_tokens)
    engine.release()
    nbytes = engine.weights.nbytes_per_token()
    row = {"quant": label, "decode_tok_s": rate, "bytes_per_token_gb": nbytes / 1e9,
           "weights_gb": engine.weights.nbytes() / 1e9, "tokens": tokens[:16]}
    if copy_tb_s:
        row["roofline_tok_s"] = copy_tb_s * 1e12 / nbytes
        row["roofline_pct"] = 100 * rate / row["roofline_tok_s"]
    return row


def _prefill(engines: dict, tokens: int, rows: list[dict]) -> None:
    """Every engine's prefill as called, the engines called in turn (common.round_robin_ms: the host's
    speed drifts between calls), and GPU time alone."""
    fns = {label: prefill_call(engine, tokens) for label, engine in engines.items()}
    timed = round_robin_ms(fns)
    for row in rows:
        row["prefill_ms"], row["prefill_host_ms"] = timed[row["quant"]]
        row["prefill_gpu_ms"] = prefill_gpu_ms(fns[row["quant"]])
    for engine in engines.values():
        engine.release()


def quant_bench(name: str, cfg: LlamaConfig, device, specs: list[str], new_tokens: int = 256,
                prefill_tokens: int = 2048, copy_tb_s: float | None = None) -> list[dict]:
    gc.collect()
    torch.cuda.empty_cache()
    rows, engines = [], {}
    for label in ["bf16"] + specs:
        weights = random_weights(cfg, device, torch.bfloat16, seed=0)
        if label != "bf16":
            weights = quantize_weights(weights, QuantSpec.parse(label))
        torch.cuda.synchronize()
        engines[label] = AccelEngine(cfg, weights, torch.device(device), "bf16")
        rows.append({"model": name, **_row(label, engines[label], new_tokens, copy_tb_s)})
        del weights
    _prefill(engines, prefill_tokens, rows)
    for row in rows:
        row["decode_speedup_vs_bf16"] = row["decode_tok_s"] / rows[0]["decode_tok_s"]
        row["prefill_ratio_vs_bf16"] = row["prefill_ms"] / rows[0]["prefill_ms"]
    del engines
    gc.collect()
    torch.cuda.empty_cache()
    return rows


MAX_REL_ERR = 2 ** -6  # a config whose result is further off is reported wrong, not timed


class QuantGemvCase:
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


# ops.norm_mlp_add's two layouts: dense weights run gate_up with the norm prologue, then down with the SwiGLU
# prologue; quantized ones the norm + gate_up + SwiGLU kernel, then down's plain GEMV with the residual
QUANT_FUSION = {"gate_up": "norm_swiglu", "down": "residual"}


def quant_step_us(what: str, N: int, K: int, fusion: str, spec: str, cfg: LlamaConfig) -> tuple[float, int]:
    """A quantized decode GEMV as the step runs it (QUANT_FUSION) -> (µs a call, the weight's bytes); gate_up's
    output is first checked against "norm, dequantize, multiply" in float64, then the SwiGLU (bf16 tolerance)."""
    fusion = QUANT_FUSION.get(what, fusion)
    if fusion != "norm_swiglu":
        case = QuantGemvCase(what, N, K, fusion, spec, cfg)
        return case.time_us(None), case.t.nbytes
    case = QuantGemvCase(what, N, K, "norm", spec, cfg)
    err = case.gate_up_swiglu_error(case.t.norm_swiglu(case.x, case.nw, 1e-5))
    if not err <= MAX_REL_ERR:  # as the sweep's check
        raise AssertionError(f"{what} {spec}: norm + gate_up + SwiGLU off by {err:.2e} (relative max)")
    return graph_us([lambda t=t: t.norm_swiglu(case.x, case.nw, 1e-5) for t in case.copies]), case.t.nbytes


def gemv_bench(cfg: LlamaConfig, device, specs: list[str]) -> list[dict]:
    """Each decode GEMV as the decode step runs it (qkv: the fused norm + qkv + RoPE + cache-write kernel; the
    norm prologues and residual epilogues; the MLP in each engine's layout, QUANT_FUSION), bf16 vs quantized, µs a
    call in a CUDA graph over >= 256 MB of weight copies (QuantGemvCase: cold L2, as in decode)."""
    rows = []
    for what, (N, K, fusion) in decode_gemv_shapes(cfg).items():
        case = QuantGemvCase(what, N, K, fusion, specs[0], cfg, min_bytes=0)  # the inputs (one weight copy)
        g = torch.Generator(device=device).manual_seed(0)
        w = (torch.randn(N, K, device=device, generator=g) * 0.02).to(torch.bfloat16)
        dense = [w] + [w.clone() for _ in range(max(0, -(-256 * 2**20 // w.nbytes) - 1))]

        def bf16_call(wc, o):
            if fusion == "rope":
                return qkv_rope_fwd(wc, case.x, case.nw, 1e-5, case.cos, case.sin, case.pos, case.ck, case.cv)
            if fusion == "norm":
                return gemv_fwd(wc, case.x, norm_weight=case.nw, eps=1e-5, out=o)
            return gemv_fwd(wc, case.x, swiglu=fusion == "swiglu", residual=o, out=o)
        outs = [case.r.clone() for _ in dense]
        us = graph_us([lambda wc=wc, o=o: bf16_call(wc, o) for wc, o in zip(dense, outs)])
        row = {"gemv": what, "N": N, "K": K, "bf16_us": us, "bf16_tb_s": w.nbytes / (us * 1e-6) / 1e12}
        del dense, outs, w
        for label in specs:
            us, nbytes = quant_step_us(what, N, K, fusion, label, cfg)
            row[f"{label}_us"] = us
            row[f"{label}_tb_s"] = nbytes / (us * 1e-6) / 1e12
            torch.cuda.empty_cache()
        rows.append(row)
    return rows


def render(result: dict) -> str:
    lines = [f"{'model':<14}{'quant':<20}{'decode tok/s':>13}{'x bf16':>8}{'% roof':>8}{'prefill ms':>12}"
             f"{'x bf16':>8}{'GB/token':>10}"]
    for r in result.get("quant", []):
        lines.append(f"{r['model']:<14}{r['quant']:<20}{r['decode_tok_s']:>13.1f}{r['decode_speedup_vs_bf16']:>8.2f}"
                     f"{r.get('roofline_pct', float('nan')):>8.1f}{r['prefill_ms']:>12.2f}"
                     f"{r['prefill_ratio_vs_bf16']:>8.2f}{r['bytes_per_token_gb']:>10.3f}")
    for model, rows in result.get("quant_gemv", {}).items():
        specs = [k[:-3] for k in rows[0] if k.endswith("_us") and k != "bf16_us"]
        lines += ["", f"decode GEMVs of {model}, µs a call in a graph (TB/s): bf16 | " + " | ".join(specs),
                  "  (MLP: bf16 gate_up with the norm, down with the SwiGLU; quantized gate_up with the norm and the "
                  "SwiGLU, down plain)"]
        for r in rows:
            cells = [f"{r['bf16_us']:.2f} ({r['bf16_tb_s']:.2f})"] + [f"{r[s + '_us']:.2f} ({r[s + '_tb_s']:.2f})"
                                                                      for s in specs]
            lines.append(f"  {r['gemv']:<8}[{r['N']}, {r['K']}]  " + " | ".join(cells))
    return "\n".join(lines)
