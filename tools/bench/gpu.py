"""Measurements for `llama32 bench`: the engine's decode and prefill, HF's eager generate on the same weights,
and the attention kernels against torch SDPA. Method and timing: tools.bench.common. Every function returns plain
numbers (ms, tok/s, TB/s).
"""
from __future__ import annotations

import gc
import time

import torch

from accel.engine import AccelEngine
from accel.weights import random_weights
from refimpl.model.config import LlamaConfig
from tools.bench.common import (cuda_profile, decode_rate, device_ms, hf_llama, median_ms, prefill_call,
                                prefill_gpu_ms, profile_decode_steps, prompt_ids)


def prefill_ms(engine: AccelEngine, tokens: int = 2048) -> tuple[float, float]:
    """(as a caller sees it: events around one eager prefill, host launch cost included; GPU time alone)."""
    fn = prefill_call(engine, tokens)
    return median_ms(fn, reps=10, warmup=2), prefill_gpu_ms(fn)


def prefill_flops(cfg: LlamaConfig, T: int) -> float:
    """Matrix FLOPs of a T-token prefill as the engine runs it: every layer's qkv GEMM on T rows; causal attention
    (half of the T×T scores), o and the MLP on T rows but in the last layer, which runs them for the last row only;
    the lm_head on the last row."""
    D, F, E, H, L = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_hidden_layers
    qkv, rest = D * (cfg.q_size + 2 * cfg.kv_size), cfg.q_size * D + 3 * D * F
    attention = 4 * T * T * E * H / 2
    last = 2 * rest + 4 * T * E * H  # one query row over T keys
    return L * 2 * T * qkv + (L - 1) * (2 * T * rest + attention) + last + 2 * D * cfg.vocab_size


def hf_generate_rate(model, prompt: list[int], new_tokens: int = 256):
    """HF eager `generate`, greedy, exactly new_tokens tokens: (tokens per second incl. its prefill, tokens)."""
    ids = torch.tensor([prompt], device=model.device)
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        model.generate(ids, **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(ids, **kw)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
    generated = out[0, len(prompt):].tolist()
    return len(generated) / elapsed, generated


def model_bench(name: str, cfg: LlamaConfig, device, with_hf: bool, new_tokens: int = 256,
                prompt_len: int = 32, prefill_tokens: int = 2048, copy_tb_s: float | None = None) -> dict:
    gc.collect()  # engines dropped earlier (the --profile ones) must not count in this model's peak
    torch.cuda.empty_cache()
    weights = random_weights(cfg, device, torch.bfloat16, seed=0)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)  # peak of the engine's own work, not of building random weights
    base = torch.cuda.memory_allocated(device)  # the weights (nothing else is allocated here now)
    engine = AccelEngine(cfg, weights, torch.device(device), "bf16")
    rate, prompt, tokens = decode_rate(engine, prompt_len, new_tokens)
    engine.release()
    pre, pre_gpu = prefill_ms(engine, prefill_tokens)
    engine.release()
    peak = torch.cuda.max_memory_allocated(device)
    torch_ops = AccelEngine(cfg, weights, torch.device(device), "bf16", use_triton=False)
    rate_torch_ops, _, _ = decode_rate(torch_ops, prompt_len, new_tokens, reps=2)
    del torch_ops
    bytes_per_token = weights.nbytes_per_token()
    row = {
        "model": name, "weights_gb": weights.nbytes() / 1e9, "bytes_per_token_gb": bytes_per_token / 1e9,
        "decode_tok_s": rate, "decode_tok_s_torch_ops": rate_torch_ops,
        "prefill_ms": pre, "prefill_gpu_ms": pre_gpu, "prefill_tokens": prefill_tokens,
        "prefill_tflop_s": prefill_flops(cfg, prefill_tokens) / (pre * 1e-3) / 1e12,
        "prefill_gpu_tflop_s": prefill_flops(cfg, prefill_tokens) / (pre_gpu * 1e-3) / 1e12,
        # our engine alone, before HF or the torch-ops engine exist: weights + the decode session (cache, graph
        # pool) and the 2048-token prefill session (cache, activations); the second number is that minus weights
        "peak_gpu_mem_gb": peak / 1e9, "peak_over_weights_gb": (peak - base) / 1e9,
    }
    if copy_tb_s:
        row["roofline_tok_s"] = copy_tb_s * 1e12 / bytes_per_token
        row["roofline_pct"] = 100 * rate / row["roofline_tok_s"]
    if with_hf:
        model = hf_llama(cfg, weights, device)
        hf_rate, hf_tokens = hf_generate_rate(model, prompt, new_tokens)
        del model
        agree = next((i for i, (a, b) in enumerate(zip(tokens, hf_tokens)) if a != b), min(len(tokens),
                                                                                          len(hf_tokens)))
        row.update({"hf_tok_s": hf_rate, "speedup_vs_hf": rate / hf_rate, "greedy_prefix_agree_with_hf": agree})
    del engine, weights
    torch.cuda.empty_cache()
    return row


def attention_bench(device, seqs=(2048, 8192), shapes=((32, 64), (24, 128)), kv_heads: int = 8) -> list[dict]:
    """Causal GQA prefill attention, bf16, forward: the Triton flash kernel vs torch SDPA, the faster of torch's
    default backend choice and the forced flash backend (K/V repeated to H heads for SDPA)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from accel.kernels.flash_attn import flash_attention_fwd
    rows = []
    for S in seqs:
        for H, E in shapes:
            g = torch.Generator(device=device).manual_seed(S + H)
            q = torch.randn(S, H, E, device=device, dtype=torch.bfloat16, generator=g)  # [T, H, E]
            k = torch.randn(kv_heads, S, E, device=device, dtype=torch.bfloat16, generator=g)  # [K, S, E]
            v = torch.randn(kv_heads, S, E, device=device, dtype=torch.bfloat16, generator=g)
            pos = torch.arange(S, device=device)
            # SDPA's flash backend takes [B, H, S, E] with K/V repeated to H heads (materialized outside timing)
            qs = q.transpose(0, 1).unsqueeze(0).contiguous()
            ks = k.repeat_interleave(H // kv_heads, 0).unsqueeze(0)
            vs = v.repeat_interleave(H // kv_heads, 0).unsqueeze(0)
            ours = flash_attention_fwd(q, k, v, pos)
            sdpa = torch.nn.functional.scaled_dot_product_attention
            ref = sdpa(qs, ks, vs, is_causal=True)
            t_default = device_ms(lambda: sdpa(qs, ks, vs, is_causal=True), 10)  # torch's own backend choice
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                t_flash = device_ms(lambda: sdpa(qs, ks, vs, is_causal=True), 10)
            t_sdpa = min(t_default, t_flash)
            err = ((ours.transpose(0, 1).float() - ref[0].float()).norm() / ref.float().norm()).item()
            t_ours = device_ms(lambda: flash_attention_fwd(q, k, v, pos), 10)
            flops = 4 * S * S * E * H / 2
            rows.append({"S": S, "H": H, "E": E, "triton_ms": t_ours, "sdpa_ms": t_sdpa,
                         "triton_tflop_s": flops / t_ours / 1e9, "sdpa_tflop_s": flops / t_sdpa / 1e9,
                         "sdpa_default_ms": t_default, "sdpa_flash_ms": t_flash,
                         "ratio_triton_over_sdpa": t_sdpa / t_ours, "rel_err_vs_sdpa": err})
    return rows


def decode_attention_bench(device, contexts=(1024, 8192, 32768), H: int = 32, K: int = 8, E: int = 64):
    """One query over a full cache of `context` slots (1B's heads): the split-K Triton kernel vs SDPA (GQA).

    in_step_us is the kernel as the decode step runs it: launched with PDL behind the step's qkv_rope (which writes
    its q and the new slot), timed as the device time the pair takes minus qkv_rope's alone. alone_us is the
    kernel by itself, without PDL, launched back to back. Both on a hot cache: the same one every call (at 1k/8k
    it sits in the L2)."""
    from accel.kernels.decode_attn import decode_attention_fwd
    rows = []
    for S in contexts:
        g = torch.Generator(device=device).manual_seed(S)
        q = torch.randn(1, H, E, device=device, dtype=torch.bfloat16, generator=g)
        ck = torch.randn(K, S, E, device=device, dtype=torch.bfloat16, generator=g)
        cv = torch.randn(K, S, E, device=device, dtype=torch.bfloat16, generator=g)
        pos = torch.tensor([S - 1], device=device)
        qs = q.transpose(0, 1).unsqueeze(0)  # [1, H, 1, E]
        ref = torch.nn.functional.scaled_dot_product_attention(qs, ck.unsqueeze(0), cv.unsqueeze(0), enable_gqa=True)
        err = ((decode_attention_fwd(q, ck, cv, pos, pdl=True)[0].float() - ref[0, :, 0].float()).norm()
               / ref.float().norm()).item()
        # a few-µs kernel launched from Python is host-bound: queue the calls behind a spin kernel, then time
        t_alone = device_ms(lambda: decode_attention_fwd(q, ck, cv, pos))
        t_sdpa = device_ms(lambda: torch.nn.functional.scaled_dot_product_attention(
            qs, ck.unsqueeze(0), cv.unsqueeze(0), enable_gqa=True))
        produce, q_step = qkv_producer(S, H, K, E, device), torch.empty_like(q)  # writes q_step and slot S - 1
        t_producer = device_ms(lambda: produce(q_step, ck, cv, pos))
        t_step = {}
        for pdl in (False, True):
            t_step[pdl] = device_ms(lambda: (produce(q_step, ck, cv, pos),
                                             decode_attention_fwd(q_step, ck, cv, pos, pdl=pdl))) - t_producer
        nbytes = 2 * K * S * E * 2
        rows.append({"context": S, "in_step_us": t_step[True] * 1e3, "sdpa_us": t_sdpa * 1e3,
                     "in_step_tb_s": nbytes / (t_step[True] * 1e-3) / 1e12, "rel_err_vs_sdpa": err,
                     "alone_us": t_alone * 1e3, "step_no_pdl_us": t_step[False] * 1e3,
                     "producer_us": t_producer * 1e3})
    return rows


def qkv_producer(S: int, H: int, K: int, E: int, device):
    """The kernel before decode attention in the decode step: qkv_rope (1B's D = 2048 at E = 64, 3B's 3072 else),
    writing q and the cache slot at `pos`. Returns f(q, cache_k, cache_v, pos)."""
    from accel.kernels.qkv_rope import qkv_rope_fwd
    D = 2048 if E == 64 else 3072
    g = torch.Generator(device=device).manual_seed(D)
    w = torch.randn((H + 2 * K) * E, D, device=device, generator=g).mul_(D ** -0.5).to(torch.bfloat16)
    x = torch.randn(1, D, device=device, generator=g).to(torch.bfloat16)
    nw = torch.randn(D, device=device, generator=g).to(torch.bfloat16)
    cos, sin = torch.randn(2, S, E // 2, device=device, generator=g)
    return lambda q, ck, cv, pos: qkv_rope_fwd(w, x, nw, 1e-5, cos, sin, pos, ck, cv, q_out=q)


def profile_decode(cfg: LlamaConfig, device, steps: int = 10, rows: int = 25) -> str:
    """Per-kernel device time of `steps` eager decode steps (no graph, so the profiler sees every kernel):
    where a token's time goes. Totals divided by `steps` are per token."""
    engine = AccelEngine(cfg, random_weights(cfg, device, torch.bfloat16), torch.device(device), "bf16",
                         use_graph=False)
    sess = engine.session(32 + steps + 8)
    return profile_decode_steps(engine, sess, engine.prefill(prompt_ids(cfg, 32), sess), 32, steps, rows)


def profile_prefill(cfg: LlamaConfig, device, tokens: int = 2048, rows: int = 20) -> str:
    """Per-kernel device time of one prefill of `tokens` tokens."""
    engine = AccelEngine(cfg, random_weights(cfg, device, torch.bfloat16), torch.device(device), "bf16",
                         use_graph=False)
    prompt = prompt_ids(cfg, tokens, seed=1)
    sess = engine.session(tokens)
    engine.prefill(prompt, sess)
    torch.cuda.synchronize()
    return cuda_profile(lambda: engine.prefill(prompt, sess), rows)
