"""Measurements for `llama32 bench --models 11b-vision`: the accel Mllama engine at the real Llama-3.2-11B-Vision
shapes on random bf16 weights (4 tiles of 560², a 512-token prompt with the image), HF transformers' eager
generate on the same weights in the same run, the decode roofline, and what the 90B model would need.

    python3 -m tools.bench.vision [--hf] [--profile] [--json-out F]

Method and timing: tools.bench.common (CUDA events after warm-up, medians, random data, everything compared
measured in the same run).
"""
from __future__ import annotations

import gc
import json
import time

import numpy as np
import torch

from accel.vision.engine import VisionAccelEngine
from accel.vision.weights import random_vision_weights
from refimpl.formats.vision_checkpoint import expected_vision_shapes, hub_name
from refimpl.model.vision_config import MllamaConfig
from refimpl.vision.inputs import ImageInputs
from tools.bench.common import (VISION_CONFIGS, copy_bandwidth, gemm_tflops, hf_bf16_model, median_ms, parser,
                                profile_decode_steps, record, require_cuda, timed_greedy, vision_config,
                                write_record)


def image_inputs(cfg: MllamaConfig, prompt_len: int, device) -> tuple[list[int], ImageInputs]:
    """A prompt of prompt_len tokens starting with one <|image|> of all max_num_tiles tiles (2×2), random pixels
    already on the device, every token seeing every tile."""
    v = cfg.vision
    g = torch.Generator().manual_seed(0)
    ids = [cfg.image_token_index] + torch.randint(0, cfg.vocab_size, (prompt_len - 1,), generator=g).tolist()
    A = v.max_num_tiles
    pixels = torch.randn(1, A, v.num_channels, v.image_size, v.image_size, device=device, dtype=torch.bfloat16)
    ratio = v.supported_aspect_ratios.index((2, 2)) + 1 if (2, 2) in v.supported_aspect_ratios else 1
    return ids, ImageInputs(pixels, np.array([ratio]), np.ones((1, A), np.int64), np.ones((prompt_len, 1, A), np.int64))


def encode_flops(cfg: MllamaConfig, images: int = 1) -> float:
    """Matrix FLOPs of the image encode: patch GEMM, every encoder layer's GEMMs and (non-causal) attention over
    all A·Q tokens, the projector, and the k/v GEMMs of every cross layer over the N image tokens."""
    v, t = cfg.vision, cfg.text
    A, P, Q, U, M = v.max_num_tiles, v.tokens_per_tile, v.padded_tokens_per_tile, v.hidden_size, v.intermediate_size
    L, N = A * Q, A * P
    layers = v.num_hidden_layers + v.num_global_layers
    per_layer = 2 * L * (4 * U * U + 2 * U * M) + 4 * L * L * U
    patch = 2 * A * (P - 1) * U * v.num_channels * v.patch_size ** 2
    proj = 2 * N * v.vision_output_dim * t.hidden_size
    kv = len(t.cross_attention_layers) * 2 * N * t.hidden_size * 2 * t.kv_size
    return images * (patch + layers * per_layer + proj + kv)


def memory_needed(cfg: MllamaConfig, context: int, images: int = 1, bytes_per: int = 2) -> dict:
    """Weights, self-attention KV at `context` positions, image K/V: bytes, from the checkpoint's shapes."""
    t, v = cfg.text, cfg.vision
    weights = sum(int(np.prod(s)) for s in expected_vision_shapes(cfg).values()) * bytes_per
    self_layers = t.num_hidden_layers - len(t.cross_attention_layers)
    kv = 2 * self_layers * t.kv_size * context * bytes_per
    image_kv = 2 * len(t.cross_attention_layers) * t.kv_size * images * v.max_num_tiles * v.tokens_per_tile * bytes_per
    return {"weights_gb": weights / 1e9, "kv_gb": kv / 1e9, "image_kv_gb": image_kv / 1e9,
            "total_gb": (weights + kv + image_kv) / 1e9}


def hf_model(cfg: MllamaConfig, params: dict, device):
    """transformers' MllamaForConditionalGeneration built on the device in bf16, holding copies of `params`."""
    import transformers
    hf = cfg.to_hf()
    hf["text_config"]["pad_token_id"] = 0  # HF's default pad id (128004) lies outside a small test vocabulary
    return hf_bf16_model(lambda: transformers.MllamaForConditionalGeneration(transformers.MllamaConfig(**hf)), device,
                         lambda name: params[hub_name(name)])


def hf_decode_rate(model, ids: list[int], images: ImageInputs, new_tokens: int) -> tuple[float, list[int]]:
    """HF eager greedy generate with the image: decode tokens per second, (n-1) / (time(n tokens) - time(1
    token)), so its encode and prefill are not counted; and the n tokens."""
    kw = dict(input_ids=torch.tensor([ids], device=model.device), pixel_values=images.pixel_values[None],
              aspect_ratio_ids=torch.as_tensor(images.aspect_ratio_ids, device=model.device)[None],
              aspect_ratio_mask=torch.as_tensor(images.aspect_ratio_mask, device=model.device)[None],
              cross_attention_mask=torch.as_tensor(images.cross_attention_mask, device=model.device)[None],
              do_sample=False, pad_token_id=0)

    def run(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(**kw, max_new_tokens=n, min_new_tokens=n)
        torch.cuda.synchronize()
        return time.perf_counter() - t0, out[0, len(ids):].tolist()

    run(2)  # warm-up
    t1, _ = run(1)
    tn, tokens = run(new_tokens)
    return (new_tokens - 1) / (tn - t1), tokens


def vision_bench(name: str, device, with_hf: bool, new_tokens: int = 128, prompt_len: int = 512,
                 copy_tb_s: float | None = None, gemm_tflop_s: float | None = None) -> dict:
    cfg = vision_config(name)
    gc.collect()
    torch.cuda.empty_cache()
    weights = random_vision_weights(cfg, device, torch.bfloat16, expected_vision_shapes(cfg))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    engine = VisionAccelEngine(cfg, weights, torch.device(device), "bf16")
    ids, images = image_inputs(cfg, prompt_len, device)
    sess = engine.session(prompt_len + new_tokens, engine.image_tokens(images))
    encode = median_ms(lambda: engine.encode_images(images, sess.cache), reps=5, warmup=2)
    prompt = torch.tensor(ids, device=device)
    prefill = median_ms(lambda: engine.prefill(prompt, sess), reps=5, warmup=2)  # the image is in the cache
    ms, tokens = timed_greedy(engine, sess, lambda: engine.prefill(prompt, sess), prompt_len, new_tokens, reps=2)
    rate = (new_tokens - 1) / (ms * 1e-3)
    peak = torch.cuda.max_memory_allocated(device)
    t = cfg.text
    self_layers = t.num_hidden_layers - len(t.cross_attention_layers)
    mid_context = prompt_len + new_tokens // 2
    kv_bytes = 2 * 2 * (self_layers * t.kv_size * mid_context + len(t.cross_attention_layers) * t.kv_size *
                        engine.image_tokens(images))  # k and v, bf16, read once a token
    flops = encode_flops(cfg)
    row = {"model": name, "tiles": cfg.vision.max_num_tiles, "image_tokens": engine.image_tokens(images),
           "prompt_tokens": prompt_len, "new_tokens": new_tokens,
           "encode_ms": encode, "encode_tflop": flops / 1e12, "encode_tflop_s": flops / (encode * 1e-3) / 1e12,
           "prefill_ms": prefill, "decode_tok_s": rate, "peak_gpu_mem_gb": peak / 1e9,
           "weights_gb": weights.nbytes() / 1e9, "bytes_per_token_gb": (weights.nbytes_per_token(cfg) + kv_bytes) / 1e9,
           "decode_graph": engine.use_graph}
    if gemm_tflop_s:
        row["encode_ms_at_gemm_rate"] = flops / (gemm_tflop_s * 1e12) * 1e3
        row["encode_over_gemm_time"] = encode / row["encode_ms_at_gemm_rate"]
    if copy_tb_s:
        row["roofline_tok_s"] = copy_tb_s * 1e12 / (row["bytes_per_token_gb"] * 1e9)
        row["roofline_pct"] = 100 * rate / row["roofline_tok_s"]
    if with_hf:
        del engine, sess
        gc.collect()
        torch.cuda.empty_cache()
        model = hf_model(cfg, weights.params, device)
        del weights
        gc.collect()
        torch.cuda.empty_cache()
        hf_rate, hf_tokens = hf_decode_rate(model, ids, images, new_tokens)
        agree = next((i for i, (a, b) in enumerate(zip(tokens.tolist(), hf_tokens)) if a != b),
                     min(len(tokens), len(hf_tokens)))
        row.update({"hf_decode_tok_s": hf_rate, "speedup_vs_hf": rate / hf_rate, "greedy_prefix_agree_with_hf": agree})
        del model
    gc.collect()
    torch.cuda.empty_cache()
    return row


def fits_report(name: str, device, context: int = 4096) -> dict:
    """Memory the model needs in bf16 (weights + KV for `context` positions + one 4-tile image) and whether it
    fits this GPU."""
    need = memory_needed(vision_config(name), context)
    total = torch.cuda.get_device_properties(device).total_memory / 1e9
    return {"model": name, "context": context, **need, "gpu_gb": total, "fits_one_gpu": need["total_gb"] < total}


def profile_decode(engine: VisionAccelEngine, ids: list[int], images: ImageInputs, steps: int = 8,
                   rows: int = 30) -> str:
    """Per-kernel device time of `steps` eager decode steps with the image in context (no graph, so the profiler
    sees every kernel): where a token's time goes; totals divided by `steps` are per token."""
    eager = VisionAccelEngine(engine.config, engine.weights, engine.device, "bf16", use_graph=False)
    sess = eager.session(len(ids) + steps + 8, eager.image_tokens(images))
    eager.encode_images(images, sess.cache)
    return profile_decode_steps(eager, sess, eager.prefill(ids, sess), len(ids), steps, rows)


def main(argv=None):
    ap = parser("tools.bench.vision", __doc__)
    ap.add_argument("--hf", action="store_true", help="also HF eager generate on the same weights")
    ap.add_argument("--profile", action="store_true", help="also the per-kernel profile of eager decode steps")
    args = ap.parse_args(argv)
    require_cuda("python3 -m tools.bench.vision")
    device = "cuda"
    result = record(copy_tb_s=copy_bandwidth(device), gemm_tflop_s=gemm_tflops(device))
    result["vision"] = vision_bench("11b-vision", device, with_hf=args.hf, copy_tb_s=result["copy_tb_s"],
                                    gemm_tflop_s=result["gemm_tflop_s"])
    result["vision_memory"] = [fits_report(name, device) for name in VISION_CONFIGS]
    print(json.dumps(result, indent=1), flush=True)
    if args.profile:
        cfg = vision_config("11b-vision")
        weights = random_vision_weights(cfg, device, torch.bfloat16, expected_vision_shapes(cfg))
        engine = VisionAccelEngine(cfg, weights, torch.device(device), "bf16")
        ids, images = image_inputs(cfg, 512, device)
        result["decode_profile"] = profile_decode(engine, ids, images)
        print(result["decode_profile"], flush=True)
    write_record(args.json_out, result)


if __name__ == "__main__":
    main()
