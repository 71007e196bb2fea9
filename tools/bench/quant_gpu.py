"""Measurements for `llama32 bench --quant`: weight-only quantized decode and prefill beside bf16, in one run.

For each model: random bf16 weights at the real shapes (seed 0); the bf16 engine is timed, then the same weights
quantized on the device (accel.quant_ops.quantize_weights) for every format, each timed the same way
(tools.bench.gpu.decode_rate / prefill_ms). Ratios are to the bf16 row measured just before. Also each decode
GEMV alone (µs a call, CUDA events over a captured graph of 20 calls), bf16 vs quantized, at the model's shapes.
"""
from __future__ import annotations

import gc

import torch

from accel.engine import AccelEngine
from accel.kernels.gemv import gemv_fwd
from accel.quant_ops import QuantTensor, qgemv, quantize, quantize_weights
from accel.weights import random_weights
from refimpl.model.config import LlamaConfig
from refimpl.quant.formats import QuantSpec
from tools.bench.gpu import decode_rate, prefill_ms
from tools.bench.timing import median_ms


def _row(label: str, engine: AccelEngine, new_tokens: int, prefill_tokens: int, copy_tb_s: float | None) -> dict:
    rate, _, tokens = decode_rate(engine, 32, new_tokens)
    engine._session = None
    pre, pre_gpu = prefill_ms(engine, prefill_tokens)
    engine._session = None
    nbytes = engine.weights.nbytes_per_token()
    row = {"quant": label, "decode_tok_s": rate, "prefill_ms": pre, "prefill_gpu_ms": pre_gpu,
           "bytes_per_token_gb": nbytes / 1e9, "weights_gb": engine.weights.nbytes() / 1e9, "tokens": tokens[:16]}
    if copy_tb_s:
        row["roofline_tok_s"] = copy_tb_s * 1e12 / nbytes
        row["roofline_pct"] = 100 * rate / row["roofline_tok_s"]
    return row


def quant_bench(name: str, cfg: LlamaConfig, device, specs: list[str], new_tokens: int = 256,
                prefill_tokens: int = 2048, copy_tb_s: float | None = None) -> list[dict]:
    gc.collect()
    torch.cuda.empty_cache()
    rows = []
    for label in ["bf16"] + specs:
        weights = random_weights(cfg, device, torch.bfloat16, seed=0)
        if label != "bf16":
            weights = quantize_weights(weights, QuantSpec.parse(label))
        torch.cuda.synchronize()
        engine = AccelEngine(cfg, weights, torch.device(device), "bf16")
        row = {"model": name, **_row(label, engine, new_tokens, prefill_tokens, copy_tb_s)}
        base = rows[0] if rows else row
        row["decode_speedup_vs_bf16"] = row["decode_tok_s"] / base["decode_tok_s"]
        row["prefill_ratio_vs_bf16"] = row["prefill_ms"] / base["prefill_ms"]
        rows.append(row)
        del engine, weights
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def _graph_us(fn, calls: int = 20) -> float:
    """µs a call of fn, replayed as one CUDA graph of `calls` calls (launch cost as in the decode step)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return median_ms(graph.replay, reps=20, warmup=3) * 1e3 / calls


def gemv_bench(cfg: LlamaConfig, device, specs: list[str]) -> list[dict]:
    """Each decode GEMV shape of the model (norm prologue where the decode step has one), bf16 vs quantized."""
    D, F, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    shapes = {"qkv": (cfg.q_size + 2 * cfg.kv_size, D), "o": (D, cfg.q_size), "gate_up": (2 * F, D),
              "down": (D, F), "lm_head": (V, D)}
    g = torch.Generator(device=device).manual_seed(0)
    rows = []
    for what, (N, K) in shapes.items():
        w = (torch.randn(N, K, device=device, generator=g) * 0.02).to(torch.bfloat16)
        x = torch.randn(1, 2 * K if what == "down" else K, device=device, generator=g).to(torch.bfloat16)
        nw = torch.ones(K, device=device, dtype=torch.bfloat16)
        r = torch.randn(1, N, device=device, generator=g).to(torch.bfloat16)

        def call(weight):
            if what == "down":
                return lambda: (qgemv if isinstance(weight, QuantTensor) else gemv_fwd)(weight, x, swiglu=True,
                                                                                       residual=r, out=r)
            if what == "o":
                return lambda: (qgemv if isinstance(weight, QuantTensor) else gemv_fwd)(weight, x, residual=r, out=r)
            return lambda: (qgemv if isinstance(weight, QuantTensor) else gemv_fwd)(weight, x, norm_weight=nw,
                                                                                   eps=1e-5)
        row = {"gemv": what, "N": N, "K": K, "bf16_us": _graph_us(call(w))}
        row["bf16_tb_s"] = w.nbytes / (row["bf16_us"] * 1e-6) / 1e12
        for label in specs:
            t = quantize(w, QuantSpec.parse(label))
            us = _graph_us(call(t))
            row[f"{label}_us"] = us
            row[f"{label}_tb_s"] = t.nbytes / (us * 1e-6) / 1e12
            del t
        rows.append(row)
        del w
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
        lines += ["", f"decode GEMVs of {model}, µs a call in a graph (TB/s): bf16 | " + " | ".join(specs)]
        for r in rows:
            cells = [f"{r['bf16_us']:.2f} ({r['bf16_tb_s']:.2f})"] + [f"{r[s + '_us']:.2f} ({r[s + '_tb_s']:.2f})"
                                                                      for s in specs]
            lines.append(f"  {r['gemv']:<8}[{r['N']}, {r['K']}]  " + " | ".join(cells))
    return "\n".join(lines)
