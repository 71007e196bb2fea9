"""The batch engine's decode step on the GPU at the 1B shape (random bf16 weights): tok/s per batch size with CUDA
graphs and eager, and the paged decode kernel's time per block size. Prints a table, writes JSON.

    python3 -m tools.bench.batch_decode [--out FILE] [--sizes 1,8,32,64,128,256] [--context 512]
"""
from __future__ import annotations

import argparse
import json
import random
import time

import torch

from accel.batch import BatchEngine, SamplingParams
from accel.kernels.paged_attn import paged_decode_attention_fwd
from accel.weights import random_weights
from refimpl.model.config import PRESETS
from tools.bench.timing import median_ms, require_cuda


def decode_tok_s(cfg, weights, B: int, context: int, steps: int, graphs: bool, block_size: int = 16):
    """-> (tok/s of engine.step() calls, device ms of one decode step's graph replay or None)."""
    eng = BatchEngine(cfg, weights, torch.device("cuda"), "bf16", max_num_seqs=max(B, 1),
                      max_num_batched_tokens=16384, num_blocks=B * (-(-(context + steps + 8) // block_size)) + 8,
                      block_size=block_size, cuda_graphs=graphs)
    rng = random.Random(B)
    for _ in range(B):
        eng.add_request([rng.randrange(cfg.vocab_size) for _ in range(context)],
                        SamplingParams(max_tokens=steps + 3, ignore_eos=True))
    while any(s.num_computed < s.num_prompt_tokens for s in eng.scheduler.running + list(eng.scheduler.waiting)):
        eng.step()  # prefills (and the first decodes)
    for _ in range(2):
        eng.step()  # graph capture happens here
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        eng.step()
    torch.cuda.synchronize()  # step() reads tokens back each step: the loop is already synchronous
    tok_s = B * steps / (time.perf_counter() - t)
    graph = next(iter(eng.runner.graphs.graphs.values())).graph if graphs else None
    if graph is not None and B == 64:
        print_kernels(graph.replay)
    return tok_s, (median_ms(graph.replay, reps=20) if graph else None)  # the last step's inputs again: harmless


def print_kernels(fn, reps: int = 5) -> None:
    """The device time of fn's kernels by name (torch.profiler), most first."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))


def copy_gb_s() -> float:
    """Device memory bandwidth as a copy of 1 GiB sees it (read + write)."""
    a = torch.empty(1 << 29, dtype=torch.int16, device="cuda")
    b = torch.empty_like(a)
    return 2 * a.nbytes / median_ms(lambda: b.copy_(a), reps=10) / 1e6


def step_bytes(cfg, weights, B: int, context: int) -> int:
    """What a decode step must read: every weight once, and each sequence's K/V of all layers."""
    kv = B * context * 2 * cfg.num_hidden_layers * cfg.kv_size * 2
    return weights.nbytes() + kv


def kernel_us(block_size: int, B: int, context: int, H=32, K=8, E=64, config=None) -> float:
    width = -(-context // block_size)
    q = torch.randn(B, H, E, device="cuda", dtype=torch.bfloat16)
    pool = torch.randn(K, B * width * block_size, E, device="cuda", dtype=torch.bfloat16)
    tables = torch.randperm(B * width, device="cuda").view(B, width).to(torch.int32)
    lens = torch.full((B,), context, device="cuda", dtype=torch.int32)
    for _ in range(2):
        paged_decode_attention_fwd(q, pool, pool, tables, lens, block_size, config=config)  # compile first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # the kernels' own time, not the host's launches
        paged_decode_attention_fwd(q, pool, pool, tables, lens, block_size, config=config)
    return 1e3 * median_ms(graph.replay, reps=20)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="batch_decode.json")
    ap.add_argument("--sizes", default="1,8,32,64,128,256")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    args = ap.parse_args()
    require_cuda("tools.bench.batch_decode")
    cfg = PRESETS["llama-3.2-1b"]
    weights = random_weights(cfg, torch.device("cuda"), torch.bfloat16)
    bw = copy_gb_s()
    print(f"copy bandwidth {bw:.0f} GB/s")
    rows = [{"what": "copy_gb_s", "value": bw}]
    for B in [int(x) for x in args.sizes.split(",")]:
        for graphs in (True, False):
            tps, replay_ms = decode_tok_s(cfg, weights, B, args.context, args.steps, graphs)
            row = {"what": "decode", "B": B, "context": args.context, "graphs": graphs, "tok_s": round(tps, 1)}
            line = f"decode B={B:4d} ctx={args.context} graphs={graphs!s:5}  {tps:10.1f} tok/s (engine.step)"
            if replay_ms is not None:
                roofline_ms = step_bytes(cfg, weights, B, args.context) / bw / 1e6
                row.update(replay_ms=replay_ms, replay_tok_s=B / replay_ms * 1e3, roofline_ms=roofline_ms)
                line += (f"  replay {replay_ms:.3f} ms = {B / replay_ms * 1e3:9.1f} tok/s, "
                         f"{roofline_ms / replay_ms:5.1%} of roofline")
            rows.append(row)
            print(line, flush=True)
    for block_size in (16, 64, 256):
        for B, context in ((1, 4096), (64, 512), (64, 2048), (256, 512)):
            us = kernel_us(block_size, B, context)
            rows.append({"what": "paged_attn", "block_size": block_size, "B": B, "context": context, "us": us})
            print(f"paged_attn block={block_size:3d} B={B:3d} ctx={context:5d}  {us:8.1f} us", flush=True)
    sweep = ({"BLOCK_N": 32}, {"BLOCK_N": 64, "num_warps": 4}, {"BLOCK_N": 64, "num_stages": 3}, {"BLOCK_N": 128},
             {"BLOCK_N": 128, "num_stages": 3}, {"BLOCK_N": 64, "num_warps": 2}, {"BLOCK_N": 128, "num_warps": 8})
    for config in sweep:
        for B, context in ((64, 512), (256, 512), (64, 2048)):
            us = kernel_us(16, B, context, config=config)
            rows.append({"what": "paged_attn_config", **config, "B": B, "context": context, "us": us})
            print(f"paged_attn {config} B={B:3d} ctx={context:5d}  {us:8.1f} us", flush=True)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
