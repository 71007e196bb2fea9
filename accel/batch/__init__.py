"""The batched engine: a paged KV cache, continuous batching and a batched step (layout after nano-vllm's engine/).

    sequence.py       a request's state (SamplingParams, RequestOutput: refimpl.batch_api)
    block_manager.py  the pool of KV blocks: tables, reference counts, prefix sharing
    scheduler.py      waiting/running queues: FCFS, chunked prefill, preemption by recompute
    runner.py         one step's flat token batch through the model over the paged cache
    graphs.py         the decode-only step as CUDA graphs, per batch-size bucket and table width
    sampler.py        per-request sampling on the device, seeded draws independent of the batch
    vision.py         Llama 3.2 Vision: each request's image keys/values, the cross-attention layers over a step
    engine.py         BatchEngine, the API
    collectives.py    what a step shares with other ranks under tensor parallelism (accel/tp/batch.py); none here
LoRA adapters per request, unmerged, several in one step: accel/lora_stack.py (the adapters stacked) over the
segmented product of accel/ops/lora_batch.py.
"""
from refimpl.batch_api import RequestOutput, SamplingParams

from .engine import BatchEngine

__all__ = ["BatchEngine", "RequestOutput", "SamplingParams"]
