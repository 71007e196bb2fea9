"""`llama32 bench --train`: LoRA training steps of the accel trainer against HF transformers + PEFT, same run.

Both train LoRA r=16 (alpha 32, no dropout) on every linear of the decoder, on the same random bf16 weights at the
real shapes, batch 1 × 2048 tokens, every token a label, AdamW; HF with SDPA attention and gradient checkpointing (as
HF + PEFT users run it to fit long sequences). Reported: optimiser steps timed with CUDA events after warm-up
(median), tokens/s, and peak allocated memory over the timed steps (resident weights included). Ours runs twice:
as `finetune` runs it without dropout (eager: each layer one Function with a hand-written backward over the Triton
kernels, LoRA in bf16 from fp32 masters, fused lm_head + cross-entropy) and with the decoder layer compiled by
torch.compile over plain-torch ops (`--compile`).
"""
from __future__ import annotations

import gc

import torch

from accel.train.lora import init_lora, target_names
from accel.train.model import TrainModel
from accel.weights import random_weights
from refimpl.formats.lora_targets import LLAMA_LINEARS
from refimpl.formats.params import expected_shapes
from refimpl.model.config import LlamaConfig
from tools.bench.common import hf_llama, median_ms


def _measure(step, tokens: int, device, reps: int) -> dict:
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    ms = median_ms(step, reps=reps, warmup=2)
    return {"step_ms": ms, "tokens_per_s": tokens / (ms * 1e-3),
            "peak_gb": torch.cuda.max_memory_allocated(device) / 2**30}


def _ids(cfg: LlamaConfig, batch: int, seq: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, cfg.vocab_size, (batch, seq), generator=g).to(device)


def ours(cfg: LlamaConfig, weights, device, seq: int, batch: int, rank: int, reps: int, compile: bool,
         profile=None, tables: list | None = None, **variant) -> dict:
    """One variant of our trainer (TrainModel's compile and `variant` keywords: kernels, lora_dtype,
    manual_backward); `profile(step)` -> a table appended to `tables`, taken after the timed steps."""
    lora = init_lora(expected_shapes(cfg), target_names(cfg, LLAMA_LINEARS), rank, 2.0, seed=0)
    for m in lora.values():
        m.a.data, m.b.data = m.a.data.to(device), m.b.data.to(device)
    model = TrainModel(weights, cfg, lora, dropout=0.0, compile=compile, **variant)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = _ids(cfg, batch, seq, device)

    losses = []

    def step():
        total, n = model.loss_sum(ids, ids)
        (total / n).backward()
        losses.append(float(total.detach()) / n)  # (one host sync a step; the first shows eager == compiled)
        opt.step()
        opt.zero_grad(set_to_none=True)

    out = {**_measure(step, batch * seq, device, reps), "first_loss": losses[0]}
    if profile is not None:
        tables.append(profile(step))
    return out


def hf_peft(cfg: LlamaConfig, held: list, device, seq: int, batch: int, rank: int, reps: int) -> dict:
    """`held` = [weights]: popped once HF has its own copy, so only HF's weights stay resident while it runs."""
    import peft
    model = hf_llama(cfg, held.pop(), device)
    gc.collect()
    torch.cuda.empty_cache()
    model.config._attn_implementation = "sdpa"
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = peft.get_peft_model(model, peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                                       target_modules=list(LLAMA_LINEARS), task_type="CAUSAL_LM"))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = _ids(cfg, batch, seq, device)

    losses = []

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(float(loss.detach()))
        opt.step()
        opt.zero_grad(set_to_none=True)

    out = {**_measure(step, batch * seq, device, reps), "first_loss": losses[0]}
    out["attn_implementation"] = model.config._attn_implementation
    return out


def train_bench(name: str, cfg: LlamaConfig, device, with_hf: bool, seq: int = 2048, batch: int = 1,
                rank: int = 16, reps: int = 5) -> dict:
    held = [random_weights(cfg, device, torch.bfloat16)]
    row = {"model": name, "seq": seq, "batch": batch, "rank": rank,
           "ours": ours(cfg, held[0], device, seq, batch, rank, reps, compile=False)}
    gc.collect()  # each run's LoRA and optimiser state go before the next is measured
    torch.cuda.empty_cache()
    try:
        row["ours_compiled"] = ours(cfg, held[0], device, seq, batch, rank, reps, compile=True)
    except Exception as e:  # a compiler failure must not lose the default path's numbers of the same run
        row["compile_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    gc.collect()
    torch.cuda.empty_cache()
    if with_hf:
        row["hf_peft"] = hf_peft(cfg, held, device, seq, batch, rank, reps)
        row["speedup"] = row["ours"]["tokens_per_s"] / row["hf_peft"]["tokens_per_s"]
        row["memory_ratio"] = row["ours"]["peak_gb"] / row["hf_peft"]["peak_gb"]
    held.clear()
    gc.collect()
    torch.cuda.empty_cache()
    return row


def render(rows: list[dict]) -> str:
    lines = [f"{'LoRA training (r=16, all linear)':<34}{'ours tok/s':>11}{'compiled':>10}{'HF tok/s':>10}"
             f"{'x HF':>7}{'ours GB':>9}{'HF GB':>8}{'mem ratio':>10}"]
    for r in rows:
        hf = r.get("hf_peft", {})
        lines.append(f"{r['model'] + ' seq %d' % r['seq']:<34}{r['ours']['tokens_per_s']:>11.0f}"
                     f"{r.get('ours_compiled', {}).get('tokens_per_s', float('nan')):>10.0f}"
                     f"{hf.get('tokens_per_s', float('nan')):>10.0f}{r.get('speedup', float('nan')):>7.2f}"
                     f"{r['ours']['peak_gb']:>9.2f}{hf.get('peak_gb', float('nan')):>8.2f}"
                     f"{r.get('memory_ratio', float('nan')):>10.2f}")
        if "compile_error" in r:
            lines.append(f"  torch.compile failed: {r['compile_error']}")
    lines.append("(ours: eager, hand-written layer backward over Triton kernels, fused cross-entropy, bf16 LoRA "
                 "from fp32 masters; "
                 "compiled: the layer under torch.compile over torch ops; HF: transformers + PEFT, SDPA, gradient "
                 "checkpointing; peak = max allocated over the timed steps)")
    return "\n".join(lines)
