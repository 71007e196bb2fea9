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


def decode_tok_s(cfg, weights, B: int, context: int, steps: int, graphs: bool, block_size: int = 16) -> float:
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
    return B * steps / (time.perf_counter() - t)


def kernel_us(block_size: int, B: int, context: int, H=32, K=8, E=64) -> float:
    width = -(-context // block_size)
    q = torch.randn(B, H, E, device="cuda", dtype=torch.bfloat16)
    pool = torch.randn(K, B * width * block_size, E, device="cuda", dtype=torch.bfloat16)
    tables = torch.randperm(B * width, device="cuda").view(B, width).to(torch.int32)
    lens = torch.full((B,), context, device="cuda", dtype=torch.int32)
    return 1e3 * median_ms(lambda: paged_decode_attention_fwd(q, pool, pool, tables, lens, block_size), reps=20)


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
    rows = []
    for B in [int(x) for x in args.sizes.split(",")]:
        for graphs in (True, False):
            tps = decode_tok_s(cfg, weights, B, args.context, args.steps, graphs)
            rows.append({"what": "decode", "B": B, "context": args.context, "graphs": graphs, "tok_s": round(tps, 1)})
            print(f"decode B={B:4d} ctx={args.context} graphs={graphs!s:5}  {tps:10.1f} tok/s", flush=True)
    for block_size in (16, 64, 256):
        for B, context in ((1, 4096), (64, 512), (64, 2048), (256, 512)):
            us = kernel_us(block_size, B, context)
            rows.append({"what": "paged_attn", "block_size": block_size, "B": B, "context": context, "us": us})
            print(f"paged_attn block={block_size:3d} B={B:3d} ctx={context:5d}  {us:8.1f} us", flush=True)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
