"""The 11B-Vision image encode on the GPU, on its own (no prefill, decode or HF):

    python -m tools.bench.encoder [--json-out F] [--profile N] [--cudnn-too]

  * encode: the engine's encode_images (encoder + projector + every cross layer's image K/V) for one image of 4
    tiles, as tools.bench.vision measures it, against its matrix FLOPs at the measured bf16 GEMM rate;
  * attention at the encoder's shape (B=1, L=4·1608, 16 heads of 80, HF's pad×pad mask), bf16: ours
    (accel.vision.encoder.self_attention: unmasked SDPA, then the padding rows masked), torch SDPA with the dense
    bool mask (the previous path), SDPA without a mask under each fused backend (a bound: not the same
    computation), flash_attn_bwd's Triton training forward without a mask (head dim padded to 128), and the
    padding rows' decode kernel alone by split length and combine;
  * --profile N: torch.profiler's table of one encode, the top N kernels by CUDA time;
  * --cudnn-too: the encode again with SDPA's cuDNN backend put first.
Prints a table; writes JSON.
"""
from __future__ import annotations

import argparse
import datetime
import json
import time

import numpy as np
import torch
import torch.nn.functional as F

from torch.nn.attention import SDPBackend, sdpa_kernel

from accel.kernels.flash_attn_bwd import flash_attn_train_fwd
from accel.kernels.decode_attn import MANY_ROWS_SPLIT, cross_decode_attention_fwd
from accel.vision.encoder import FEW_ROWS, PaddingRows, self_attention
from accel.vision.engine import VisionAccelEngine
from accel.vision.weights import random_vision_weights
from refimpl.formats.vision_checkpoint import expected_vision_shapes
from refimpl.vision.encoder import padding_tokens
from tools.bench.gpu import gemm_tflops
from tools.bench.timing import cuda_profile, device_ms, median_ms
from tools.bench.vision import config, encode_flops, image_inputs

def attention_rows(tiles=(1, 1, 1, 1)) -> list[dict]:
    A, P, Q, H, E = len(tiles), 1601, 1608, 16, 80
    L = A * Q
    flops = 4 * L * L * H * E
    g = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(L, 3 * H * E, device="cuda", generator=g).to(torch.bfloat16)
    q, k, v = qkv.view(1, L, 3, H, E).unbind(2)  # [1, L, H, E] views, as the encoder passes them
    pad = torch.as_tensor(padding_tokens(np.array([tiles]), P, Q), device="cuda")  # [1, L]
    visible = ~(pad[:, :, None] & pad[:, None, :])[:, None]  # [1, 1, L, L]
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # [1, H, L, E]
    want = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=visible).transpose(1, 2)
    rows = []

    def row(name, fn, check=True, **extra):
        err = float((fn().float() - want.float()).abs().max()) if check else None
        ms = device_ms(fn, reps=10)
        rows.append({"name": name, "ms": ms, "tflop_s": flops / (ms * 1e-3) / 1e12, "max_abs_err_vs_sdpa": err,
                     **extra})
        print(f"  {name:<44}{ms:9.3f} ms {rows[-1]['tflop_s']:7.1f} TFLOP/s  err {err}", flush=True)

    print(f"attention B=1 L={L} H={H} E={E}, bf16 (FLOPs 4·L²·H·E = {flops / 1e12:.2f} T)")
    rows_fix = PaddingRows(np.array([tiles]), P, Q, "cuda")
    row("ours (unmasked sdpa + padding rows again)",
        lambda: self_attention(qkv, rows_fix, 1, H, E).view(1, L, H, E),
        padding_rows=sum(len(r) for _, r, _, _ in rows_fix.images))
    row("sdpa, dense bool mask (previous path)",
        lambda: F.scaled_dot_product_attention(qt, kt, vt, attn_mask=visible).transpose(1, 2))
    row("sdpa, no mask, torch's choice (bound)", lambda: F.scaled_dot_product_attention(qt, kt, vt), check=False)
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        def only(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qt, kt, vt)
        try:
            row(f"sdpa, no mask, {name} only (bound)", only, check=False)
        except RuntimeError as e:  # backend unavailable for this shape/dtype
            print(f"  sdpa {name}: {str(e)[:100]}", flush=True)
    row("flash_attn_bwd fwd, no mask (E pad 128)", lambda: flash_attn_train_fwd(q, k, v, causal=False)[0],
        check=False)
    for _, pr, real, _ in rows_fix.images[:1]:  # the padding rows' kernel alone, by split length (a full image)
        if len(pr) > FEW_ROWS:
            continue
        qi = qt[0][:, pr].reshape(1, -1, E)  # [1, H·R, E]
        for split, fused in ((256, False), (512, False), (1024, False), (256, True), (512, True), (1024, True)):
            ms = device_ms(lambda: cross_decode_attention_fwd(qi, kt[0], vt[0], real, None, 0.0, split_len=split,
                                                              config={"FUSED": fused}))
            name = f"padding rows alone, split {split}, {'fused' if fused else 'separate'} combine"
            rows.append({"name": name, "ms": ms, "padding_rows": len(pr),
                         "used": split == MANY_ROWS_SPLIT and not fused})  # the default for these rows
            print(f"  {name} ({len(pr)} rows){ms * 1e3:9.1f} us", flush=True)
    return rows


def encode_row(name: str, gemm: float, profile: int, cudnn_too: bool) -> dict:
    cfg = config(name)
    weights = random_vision_weights(cfg, "cuda", torch.bfloat16, expected_vision_shapes(cfg))
    engine = VisionAccelEngine(cfg, weights, torch.device("cuda"), "bf16")
    _, images = image_inputs(cfg, 16, "cuda")
    sess = engine.session(16, engine.image_tokens(images))
    ms = median_ms(lambda: engine.encode_images(images, sess.cache), reps=7, warmup=2)
    flops = encode_flops(cfg)
    at_gemm = flops / (gemm * 1e12) * 1e3
    row = {"model": name, "encode_ms": ms, "encode_tflop": flops / 1e12, "encode_tflop_s": flops / (ms * 1e-3) / 1e12,
           "gemm_tflop_s": gemm, "encode_ms_at_gemm_rate": at_gemm, "encode_over_gemm_time": ms / at_gemm}
    if cudnn_too:
        try:
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                              SDPBackend.MATH], set_priority=True):
                row["encode_ms_cudnn_first"] = median_ms(lambda: engine.encode_images(images, sess.cache), reps=7,
                                                         warmup=2)
            print(f"encode with cuDNN attention first: {row['encode_ms_cudnn_first']:.2f} ms", flush=True)
        except (RuntimeError, TypeError) as e:
            print(f"encode with cuDNN first failed: {str(e)[:200]}", flush=True)
    print(f"encode {name}: {ms:.2f} ms, {row['encode_tflop_s']:.1f} TFLOP/s, {row['encode_over_gemm_time']:.2f}x "
          f"the {at_gemm:.1f} ms of {flops / 1e12:.1f} TFLOP at {gemm:.0f} TFLOP/s", flush=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    engine.encode_images(images, sess.cache)  # the host's time to issue it: near encode_ms means launch-bound
    row["encode_host_issue_ms"] = (time.perf_counter() - start) * 1e3
    torch.cuda.synchronize()
    print(f"host time to issue one encode: {row['encode_host_issue_ms']:.2f} ms", flush=True)
    if profile:
        table, events = cuda_profile(lambda: engine.encode_images(images, sess.cache), profile, host=True)
        print(table, flush=True)
        gpu = [e for e in events if e.device_time_total > 0 and e.device_type == torch.autograd.DeviceType.CUDA]
        row["profile"] = [{"name": e.key, "cuda_ms": e.device_time_total / 1e3, "calls": e.count}
                          for e in sorted(gpu, key=lambda e: -e.device_time_total)[:profile]]
        row["kernel_ms_total"] = sum(e.device_time_total for e in gpu) / 1e3
        # host syncs inside one encode (the profiled call's own synchronize is the last one)
        row["host_sync_calls"] = {e.key: e.count for e in events
                                  if "Synchronize" in e.key or e.key in ("cudaMemcpy", "cudaMemcpyAsync", "aten::item")}
        print(f"kernel time {row['kernel_ms_total']:.2f} ms; sync-like calls {row['host_sync_calls']}", flush=True)
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--cudnn-too", action="store_true")
    ap.add_argument("--profile", type=int, default=0, help="top N kernels of one encode (0: no profile)")
    ap.add_argument("--skip-attention", action="store_true")
    args = ap.parse_args(argv)
    gemm = gemm_tflops("cuda")
    print(f"bf16 GEMM {gemm:.0f} TFLOP/s on {torch.cuda.get_device_name()}", flush=True)
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__, "gemm_tflop_s": gemm}
    result["encode"] = encode_row("11b-vision", gemm, args.profile, args.cudnn_too)
    if not args.skip_attention:
        result["attention"] = attention_rows()
        result["attention_padding_tiles"] = attention_rows((1, 1, 0, 0))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
