"""What every benchmark shares: the model names and shapes, the argument parser, the results record, timing, the
engines at work and HF transformers' baselines (cli.py, timing.py, runs.py, hf.py; all of it here, as common.X).

Benchmarks are leaves over this package: each imports it and the runtime, never another benchmark.
Method (docs/performance.md): CUDA events after warm-up, medians of repeats, random data (never zeros or
uninitialised memory), anything compared measured in the same run. torch is imported where a function needs it,
so the CPU benchmarks (cpu, startup, load, quant_quality) can use the parser and the record without it.
"""
from __future__ import annotations

from .cli import (MODELS, VISION_11B, VISION_CONFIGS, vision_config, model_config, decode_gemv_shapes, model_keys,
                  parser, device_name, version, command_line, record, write_record, require_cuda, require_gpus, table)
from .timing import (median_ms, round_robin_ms, device_ms, graph_us, allreduce_us, cuda_profile, profile_decode_steps,
                     copy_bandwidth, gemm_tflops)
from .runs import (prompt_ids, timed_greedy, decode_rate, sync, free_gpu, timed_batch_steps, abort_all, prefill_call,
                   prefill_gpu_ms)
from .hf import (HF_MEMORY, hf_bf16_model, hf_llama, HF_ROPE_32, HF_VISION_11B, hf_random_model, hf_image_inputs,
                 hf_text_inputs, hf_model, hf_config, hf_cb_config, hf_batch_seconds, hf_decode_rate, hf_workload)

__all__ = ["MODELS", "VISION_11B", "VISION_CONFIGS", "vision_config", "model_config", "decode_gemv_shapes",
           "model_keys", "parser", "device_name", "version", "command_line", "record", "write_record", "require_cuda",
           "require_gpus", "table", "median_ms", "round_robin_ms", "device_ms", "graph_us", "allreduce_us",
           "cuda_profile", "profile_decode_steps", "copy_bandwidth", "gemm_tflops", "prompt_ids", "timed_greedy",
           "decode_rate", "sync", "free_gpu", "timed_batch_steps", "abort_all", "prefill_call", "prefill_gpu_ms",
           "HF_MEMORY", "hf_bf16_model", "hf_llama", "HF_ROPE_32", "HF_VISION_11B", "hf_random_model",
           "hf_image_inputs", "hf_text_inputs", "hf_model", "hf_config", "hf_cb_config", "hf_batch_seconds",
           "hf_decode_rate", "hf_workload"]
