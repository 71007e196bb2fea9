"""Where a LoRA training step's time goes: the trainer's variants timed, and torch.profiler tables of one step.

`python -m tools.bench.train_profile [--model 1b] [--seq 2048] [--json-out F]`: the `bench --train` setup (random
bf16 weights at the real shapes, LoRA r=16 on every linear, AdamW, batch 1, every token a label), ours only, each
variant = (torch.compile of the layer, the Triton norm/RoPE/SwiGLU Functions, the LoRA branch's compute dtype,
the hand-written layer backward).
Prints per variant the median step and peak memory, and for the variants named by --profile the top CUDA kernels of
one step (self CUDA time, summed over calls).
"""
from __future__ import annotations

import argparse
import gc
import json

import torch

from tools.bench.train import ours
from accel.weights import random_weights
from refimpl.model.config import PRESETS

MODELS = {"1b": "llama-3.2-1b", "3b": "llama-3.2-3b"}
VARIANTS = {  # name: (compile, TrainModel keywords)
    "eager-kernels-bf16lora-manual": (False, dict(kernels=True, lora_dtype=None, manual_backward=True)),
    "eager-kernels-bf16lora": (False, dict(kernels=True, lora_dtype=None, manual_backward=False)),
    "compiled-torch-fp32lora": (True, dict(kernels=False, lora_dtype=torch.float32)),
    "eager-kernels-fp32lora": (False, dict(kernels=True, lora_dtype=torch.float32)),
    "compiled-kernels-bf16lora": (True, dict(kernels=True, lora_dtype=None)),
    "compiled-torch-bf16lora": (True, dict(kernels=False, lora_dtype=None)),
}


def profile_table(step, rows: int = 18) -> str:
    """Top CUDA kernels of one step by self time, then the top host-side ops by self CPU time, and how much of
    the step's wall time the GPU was busy (the kernels' summed time)."""
    import time
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - t0) * 1e3
    ka = prof.key_averages()
    # kernels only: an aten op's entry also carries its kernels' device time, which would count them twice
    busy_ms = sum(e.self_device_time_total for e in ka if e.device_type == DeviceType.CUDA) / 1e3
    n_ops = sum(e.count for e in ka if e.key.startswith("aten::"))
    return "\n".join([
        ka.table(sort_by="self_cuda_time_total", row_limit=rows, max_name_column_width=60),
        ka.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60),
        f"one profiled step: wall {wall_ms:.1f} ms (profiler overhead included), GPU kernels {busy_ms:.1f} ms, "
        f"{n_ops} aten ops"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="1b", choices=sorted(MODELS))
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--profile", default="eager-kernels-bf16lora-manual")
    ap.add_argument("--json-out")
    args = ap.parse_args()
    device = torch.device("cuda")
    cfg = PRESETS[MODELS[args.model]]
    weights = random_weights(cfg, device, torch.bfloat16)
    results, all_tables = {}, {}
    for name in args.variants.split(","):
        compile, variant = VARIANTS[name]
        tables = []
        try:
            r = ours(cfg, weights, device, args.seq, 1, 16, reps=5, compile=compile,
                     profile=(profile_table if name in args.profile.split(",") else None), tables=tables, **variant)
        except Exception as e:  # one failing variant must not lose the others' numbers
            results[name] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
            print(f"{name:<28} failed: {results[name]['error']}", flush=True)
            continue
        results[name] = r
        print(f"{name:<28} {r['step_ms']:8.1f} ms  {r['tokens_per_s']:8.0f} tok/s  {r['peak_gb']:6.2f} GiB  "
              f"first loss {r['first_loss']:.4f}", flush=True)
        for t in tables:
            print(t, flush=True)
            all_tables[name] = t
        gc.collect()
        torch.cuda.empty_cache()
        if args.json_out:  # after every variant: a run cut short keeps what it measured
            with open(args.json_out, "w") as f:
                json.dump({"model": MODELS[args.model], "seq": args.seq, "device": torch.cuda.get_device_name(),
                           "torch": torch.__version__, "variants": results, "tables": all_tables}, f, indent=2)


if __name__ == "__main__":
    main()
