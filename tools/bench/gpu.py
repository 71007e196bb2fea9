"""Measurements for `llama32 bench`: device ceilings, the engine's decode and prefill, HF's eager
generate on the same weights, and the attention kernels against torch SDPA.

Method (shared/BASELINES.md, device METHOD.md): CUDA events after warm-up, median of repeats, random data (never
zeros), anything compared measured in the same run. Every function returns plain numbers (ms, tok/s, TB/s).
"""
from __future__ import annotations

import gc
import statistics
import time

import torch

from refimpl.model.config import LlamaConfig

from accel.engine import AccelEngine
from accel.kernels.tuning import DEFAULT, Tuning
from tools.bench.timing import cuda_profile, device_ms, median_ms, profile_decode_steps
from accel.weights import Weights, params_view, random_weights


def copy_bandwidth(device, nbytes: int = 2**31) -> float:
    """Device-to-device copy, bytes read + written per second (TB/s), on a 2 GiB random buffer (>> 60 MB L2)."""
    src = torch.randn(nbytes // 2, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), reps=20, warmup=3)
    return 2 * nbytes / (ms * 1e-3) / 1e12


def gemm_tflops(device, n: int = 8192) -> float:
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    ms = median_ms(lambda: a @ b, reps=20, warmup=3)
    return 2 * n**3 / (ms * 1e-3) / 1e12


def prompt_ids(cfg: LlamaConfig, n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist()


def decode_rate(engine: AccelEngine, prompt_len: int = 32, new_tokens: int = 256, reps: int = 3):
    """Batch-1 greedy decode: (steps per second, the tokens). The loop never syncs with the host; events time
    the new_tokens - 1 graph replays (+ argmax each), after a 32-token prefill outside the timed region."""
    prompt = prompt_ids(engine.config, prompt_len)
    sess = engine.session(prompt_len + new_tokens)
    ms, tokens = timed_greedy(engine, sess, lambda: engine.prefill(prompt, sess), prompt_len, new_tokens, reps)
    return (new_tokens - 1) / (ms * 1e-3), prompt, tokens.tolist()


def timed_greedy(engine, sess, prefill, start: int, new_tokens: int, reps: int = 3):
    """(median ms of the new_tokens - 1 greedy graph replays after `prefill()`'s logits, the tokens); the first
    of reps + 1 runs is the warm-up (graph capture)."""
    times, tokens = [], None
    for r in range(reps + 1):
        logits = prefill()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        tokens = engine.decode_greedy(sess, logits, start, new_tokens)
        end.record()
        end.synchronize()
        if r:
            times.append(begin.elapsed_time(end))
    return statistics.median(times), tokens


def prefill_call(engine: AccelEngine, tokens: int = 2048, prompt: torch.Tensor | None = None):
    """A no-argument call of the engine's prefill of a `tokens`-token prompt (built on the device once: no copy
    in the timing) into a session of its own."""
    if prompt is None:
        prompt = torch.tensor(prompt_ids(engine.config, tokens, seed=1), device=engine.device)
    sess = engine.session(tokens)
    return lambda: engine.prefill(prompt, sess)


def prefill_gpu_ms(fn) -> float:
    """A prefill call's GPU time alone (timing.device_ms, a spin long enough to queue a 2048-token prefill)."""
    return device_ms(fn, reps=3, sleep_cycles=100_000_000)


def prefill_ms(engine: AccelEngine, tokens: int = 2048) -> tuple[float, float]:
    """(as a caller sees it: events around one eager prefill, host launch cost included; GPU time alone)."""
    fn = prefill_call(engine, tokens)
    return median_ms(fn, reps=10, warmup=2), prefill_gpu_ms(fn)


def prefill_flops(cfg: LlamaConfig, T: int) -> float:
    """Matrix FLOPs of a T-token prefill as the engine runs it: every layer's qkv GEMM on T rows; causal attention
    (half of the T×T scores), o and the MLP on T rows but in the last layer, which runs them for the last row only
    (accel.model.PrefillOptions.last_row); the lm_head on the last row."""
    D, F, E, H, L = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_hidden_layers
    qkv, rest = D * (cfg.q_size + 2 * cfg.kv_size), cfg.q_size * D + 3 * D * F
    attention = 4 * T * T * E * H / 2
    last = 2 * rest + 4 * T * E * H  # one query row over T keys
    return L * 2 * T * qkv + (L - 1) * (2 * T * rest + attention) + last + 2 * D * cfg.vocab_size


def hf_model(cfg: LlamaConfig, weights: Weights, device):
    """transformers' LlamaForCausalLM built on the device in bf16, holding copies of the same tensors."""
    import transformers
    views = params_view(weights, cfg)
    if cfg.tie_word_embeddings:
        views.setdefault("lm_head.weight", weights.lm_head)
    return hf_bf16_model(lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg.to_hf())), device,
                         views.__getitem__)


def hf_bf16_model(build, device, param_of):
    """build()'s HF model, made on the device in bf16 (the default dtype during the build), in eval mode, each
    parameter a copy of param_of(its name)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = build().eval()
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(param_of(name))
    return model


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
    engine._session = None
    pre, pre_gpu = prefill_ms(engine, prefill_tokens)
    engine._session = None
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
        model = hf_model(cfg, weights, device)
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
    kernel by itself, without PDL, launched back to back (the earlier measure). Both on a hot cache: the same
    one every call (at 1k/8k it sits in the L2; tools.bench.attn_sweep times cold caches too)."""
    from accel.kernels.decode_attn import decode_attention_fwd
    from tools.bench.attn_sweep import qkv_producer
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


def profile_decode(cfg: LlamaConfig, device, steps: int = 10, rows: int = 25, tuning: Tuning = DEFAULT) -> str:
    """Per-kernel device time of `steps` eager decode steps (no graph, so the profiler sees every kernel):
    where a token's time goes. Totals divided by `steps` are per token."""
    engine = AccelEngine(cfg, random_weights(cfg, device, torch.bfloat16), torch.device(device), "bf16",
                         use_graph=False, tuning=tuning)
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
    return cuda_profile(lambda: engine.prefill(prompt, sess), rows)[0]
