"""Tensor-parallel Llama 3.2 Vision (accel.tp) at the real sizes: batch-1 greedy decode with one image (4 tiles of
560², its keys/values in every cross layer's cache) on random weights drawn as each rank's shard on its own GPU
(accel.tp.random_shard: no checkpoint, no tensor ever whole), for each run MODEL:N of N ranks (one GPU each,
NCCL), against its roofline: the bytes one token reads on all ranks (weights, self-attention KV, image K/V) over
the sum of the ranks' measured copy bandwidths. 90B-Vision runs in bf16 where its shard fits every GPU's free
memory, else in int8 (--quant auto); a run that fits in neither, or wants more GPUs than there are, is reported
as skipped.

    python3 -m tools.bench.tp_vision [--runs 11b-vision:1,11b-vision:2,90b-vision:2] [--quant auto|bf16|int8]
                                     [--prompt 64] [--tokens 32] [--reps 3] [--profile ROWS] [--json-out F]

Method: tools.bench.common (random data, everything compared measured in the same run). The prompt runs the eager
forward per shard; each decoded token the fused decode step (accel.tp.vision_engine), one CUDA graph replay a
token with the all-reduces captured in it, timed as tools.bench.common.timed_greedy times a one-GPU engine: the
greedy graph's replays (argmax on the device, no host sync), the median of --reps after a warm-up run. "of it AR":
the ms of a token its all-reduces take (2 a layer, each timed alone in a graph of them: tools.bench.tp); "peak
GB": the most any rank had allocated on its GPU during the run (torch.cuda.max_memory_allocated: the shard, its
quantization's temporaries, caches and activations).
"""
from __future__ import annotations

import time

import numpy as np
import torch
import torch.distributed as dist

from accel.tp.group import TPGroup, end_group, spawn
from accel.tp.vision_engine import TPVisionEngine
from accel.tp.vision_load import VisionShardPlan, random_vision_shard, vision_shard_elements
from refimpl.quant.schemes import QuantSpec
from refimpl.vision.inputs import ImageInputs
from tools.bench.common import allreduce_us, copy_bandwidth, cuda_profile, parser, record, require_cuda, timed_greedy, \
    vision_config, write_record

HEADROOM = 8 << 30  # bytes a GPU keeps beyond the shard: the copy-bandwidth buffers, caches, activations


def image_prompt(cfg, prompt_len: int):
    """ids: one <|image|> then random text; the image: all max_num_tiles tiles (2×2), every token seeing them."""
    v = cfg.vision
    g = torch.Generator().manual_seed(0)
    ids = [cfg.image_token_index] + torch.randint(0, cfg.vocab_size, (prompt_len - 1,), generator=g).tolist()
    A = v.max_num_tiles
    pixels = torch.randn(1, A, v.num_channels, v.image_size, v.image_size, generator=g).numpy()
    ratio = v.supported_aspect_ratios.index((2, 2)) + 1
    return ids, ImageInputs(pixels, np.array([ratio]), np.ones((1, A), np.int64), np.ones((prompt_len, 1, A), np.int64))


def step_bytes(engine: TPVisionEngine, cache, context: int) -> int:
    """Bytes one decode step reads on this rank: every matrix and norm once, one embedding row, the lm_head
    slice, the self layers' K/V at `context` positions, and the image K/V of every cross layer."""
    w = engine.vision_weights
    tensors = [w.text.norm, w.text.lm_head]
    for lw in w.text.layers:
        tensors += [lw.attn_norm, lw.qkv, lw.o, lw.mlp_norm, lw.gate_up, lw.down]
    for cl in w.cross:
        tensors += [cl.attn_norm, cl.q, cl.q_norm, cl.o, cl.mlp_norm, cl.gate_up, cl.down]
    kv = cache.k_all[:, :, :context]
    return (sum(t.nbytes for t in tensors) + w.text.embed[0].nbytes + 2 * kv.nbytes + cache.xk_all.nbytes
            + cache.xv_all.nbytes)


def _timed(fn) -> tuple[float, object]:
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t, out


def measure(group: TPGroup, name: str, quant: str, prompt_len: int, tokens: int, reps: int,
            profile: int = 0) -> dict:
    """Every rank: its shard drawn, the decode step captured, the image encoded, the prompt, then `tokens` greedy
    steps, timed (reps runs after a warm-up) -> rank 0's record of the run (each rank's numbers gathered); with
    `profile` rows, rank 0's per-kernel device times of one more run (torch.profiler's table)."""
    cfg = vision_config(name)
    torch.cuda.reset_peak_memory_stats(group.device)  # rank 0 ran the earlier runs too
    bandwidth = copy_bandwidth(group.device)
    spec = None if quant == "bf16" else QuantSpec.parse(quant)
    plan = VisionShardPlan(cfg, group.rank, group.world)
    build_s, weights = _timed(lambda: random_vision_shard(plan, group.device, torch.bfloat16, spec))
    engine = TPVisionEngine(group, cfg, weights, "bf16")
    ids, images = image_prompt(cfg, prompt_len)
    capacity = prompt_len + tokens
    capture_s, sess = _timed(lambda: engine.session(capacity, engine.image_tokens(1)))
    encode_s, _ = _timed(lambda: engine.image_request(images if group.is_root else None, prompt_len, capacity))
    prompt = torch.tensor(ids, device=group.device)
    prefill_s, _ = _timed(lambda: engine.forward(prompt, 0, sess))
    ms, _ = timed_greedy(engine, sess, lambda: engine.forward(prompt, 0, sess), prompt_len, tokens, reps)
    kernels = None
    if profile:  # every rank decodes; rank 0's kernels are recorded (their totals over tokens - 1 steps)
        logits = engine.forward(prompt, 0, sess)
        greedy = lambda: engine.decode_greedy(sess, logits, prompt_len, tokens)  # noqa: E731
        kernels = cuda_profile(greedy, profile) if group.is_root else greedy()
        torch.cuda.synchronize()
    reduce_us = 0.0
    if group.world > 1:  # the decode step's all-reduces: 2 a layer (self and cross alike)
        reduce_us = allreduce_us(engine.rank_split(), cfg.text.hidden_size, cfg.text.num_hidden_layers, group.device)
    peak = torch.cuda.max_memory_allocated(group.device)
    mine = torch.tensor([step_bytes(engine, sess.cache, prompt_len + tokens // 2), bandwidth * 1e12, peak],
                        dtype=torch.float64, device=group.device)  # the KV read at the timed steps' middle position
    every = [torch.empty_like(mine) for _ in range(group.world)]
    dist.all_gather(every, mine)
    per_rank = torch.stack(every).cpu().numpy()  # [N, 3]: bytes a token, bytes/s, peak bytes allocated
    roofline = per_rank[:, 1].sum() / per_rank[:, 0].sum()
    rate = (tokens - 1) / (ms * 1e-3)
    return {"model": name, "ranks": group.world, "weights": quant, "build_s": build_s,
            "capture_ms": capture_s * 1e3, "encode_ms": encode_s * 1e3, "prefill_ms": prefill_s * 1e3,
            "prompt_tokens": prompt_len, "decode_tokens": tokens, "decode_ms_per_token": ms / (tokens - 1),
            "decode_tokens_per_s": rate, "allreduce_us": reduce_us,
            "allreduce_ms_per_token": 2 * cfg.text.num_hidden_layers * reduce_us / 1e3,
            "roofline_tokens_per_s": roofline, "of_roofline": rate / roofline,
            "bytes_per_token_gb": per_rank[:, 0].sum() / 1e9, "copy_tb_s": (per_rank[:, 1] / 1e12).tolist(),
            "peak_gb_per_rank": (per_rank[:, 2] / 1e9).tolist(),
            "shard_elements_per_rank": vision_shard_elements(plan), "kernels": kernels if group.is_root else None}


def _serve(group: TPGroup, *args) -> None:
    measure(group, *args)


def run(name: str, world: int, quant: str, prompt_len: int, tokens: int, reps: int, profile: int) -> dict:
    """One MODEL:N run: ranks 1..N-1 spawned, this process rank 0 (accel.tp.group.spawn)."""
    group, procs = spawn(world, "cuda", _serve, (name, quant, prompt_len, tokens, reps, profile))
    try:
        return measure(group, name, quant, prompt_len, tokens, reps, profile)
    finally:
        end_group(group)
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():  # stuck in a collective its peer left
                p.kill()
        torch.cuda.empty_cache()


def pick_weights(name: str, world: int, quant: str) -> tuple[str | None, str]:
    """(bf16 | int8 | None to skip, why): --quant auto takes bf16 where every rank's shard and HEADROOM fit its
    GPU's free memory, else int8 where that fits."""
    if world > torch.cuda.device_count():
        return None, f"needs {world} GPUs, this machine has {torch.cuda.device_count()}"
    cfg = vision_config(name)
    elements = max(vision_shard_elements(VisionShardPlan(cfg, r, world)) for r in range(world))
    free = min(torch.cuda.mem_get_info(r)[0] for r in range(world))
    for choice, per in (("bf16", 2), ("int8", 1)):
        need = elements * per + HEADROOM
        if quant in ("auto", choice) and need <= free:
            return choice, f"{need / 1e9:.0f} GB a rank with headroom, {free / 1e9:.0f} GB free"
    return None, f"a rank's shard does not fit {free / 1e9:.0f} GB free in {quant}"


def run_spec(text: str) -> tuple[str, int]:
    name, _, n = text.partition(":")
    return name.strip(), int(n or 1)


def main(argv=None) -> None:
    ap = parser("tools.bench.tp_vision", __doc__)
    ap.add_argument("--runs", default="11b-vision:1,11b-vision:2,90b-vision:2",
                    help="comma-separated MODEL:RANKS, MODEL of 11b-vision, 90b-vision")
    ap.add_argument("--quant", choices=["auto", "bf16", "int8"], default="auto",
                    help="the weights: auto = bf16 where the shard fits, else int8")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens (the image token first)")
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens a timed run decodes (at least 2)")
    ap.add_argument("--reps", type=int, default=3, help="timed runs (their median), after one warm-up run")
    ap.add_argument("--profile", type=int, default=0, metavar="ROWS",
                    help="also print rank 0's top ROWS kernels by device time over one more run's decode steps")
    args = ap.parse_args(argv)
    if args.tokens < 2 or args.reps < 1 or args.prompt < 1:
        ap.error("--tokens must be at least 2, --reps and --prompt at least 1")
    runs = [run_spec(r) for r in args.runs.split(",") if r.strip()]
    bad = [n for n, _ in runs if n not in ("11b-vision", "90b-vision")]
    if bad:
        ap.error(f"--runs: unknown model {bad[0]!r}; expected 11b-vision or 90b-vision")
    require_cuda("python3 -m tools.bench.tp_vision")
    results = []
    print(f"{'model':<12}{'ranks':>6}{'weights':>8}{'encode ms':>10}{'prefill ms':>11}{'tok/s':>8}"
          f"{'roofline':>9}{'%':>6}{'GB/token':>9}{'ms/token':>9}{'of it AR':>9}{'peak GB':>8}", flush=True)
    for name, world in runs:
        weights, why = pick_weights(name, world, args.quant)
        if weights is None:
            results.append({"model": name, "ranks": world, "skipped": why})
            print(f"{name:<12}{world:>6}  skipped: {why}", flush=True)
            continue
        try:
            r = run(name, world, weights, args.prompt, args.tokens, args.reps, args.profile)
        except Exception as e:  # noqa: BLE001  one run's failure is its row; the others still run
            results.append({"model": name, "ranks": world, "weights": weights, "error": f"{type(e).__name__}: {e}"})
            print(f"{name:<12}{world:>6}  failed: {type(e).__name__}: {e}", flush=True)
            continue
        r["fits"] = why
        results.append(r)
        print(f"{name:<12}{world:>6}{weights:>8}{r['encode_ms']:>10.1f}{r['prefill_ms']:>11.1f}"
              f"{r['decode_tokens_per_s']:>8.1f}{r['roofline_tokens_per_s']:>9.1f}{100 * r['of_roofline']:>6.1f}"
              f"{r['bytes_per_token_gb']:>9.2f}{r['decode_ms_per_token']:>9.2f}{r['allreduce_ms_per_token']:>9.2f}"
              f"{max(r['peak_gb_per_rank']):>8.1f}", flush=True)
        if r["kernels"]:
            print(f"rank 0's kernels over {args.tokens - 1} decode steps:\n{r['kernels']}", flush=True)
    rec = record("cuda", runs=results)
    one = {r["ranks"]: r for r in results if r["model"] == "11b-vision" and "decode_tokens_per_s" in r}
    if 1 in one and 2 in one:
        rec["11b_tp2_over_tp1"] = one[2]["decode_tokens_per_s"] / one[1]["decode_tokens_per_s"]
        print(f"11b-vision TP=2 / TP=1 decode: {rec['11b_tp2_over_tp1']:.2f}x", flush=True)
    write_record(args.json_out, rec)


if __name__ == "__main__":
    main()
