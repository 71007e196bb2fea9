"""How much memory the batch engine's caches take: the paged KV pool's blocks, and a vision model's share for its
requests' image keys/values (kept beside the pool: accel/batch/vision.py).
"""
from __future__ import annotations

import torch

from refimpl.errors import GenerationError
from refimpl.model.config import LlamaConfig

from .runner import ModelRunner

CPU_KV_BYTES = 1 << 30  # the KV pool's budget on CPU, where free memory says little about what is wise to take
IMAGE_KV_SHARE = 0.25  # of a vision model's KV budget kept for its requests' image keys/values (vision.py)


def kv_budget(cfg: LlamaConfig, device: torch.device, dtype: torch.dtype, gpu_memory, max_num_seqs: int,
              max_num_batched_tokens: int) -> int:
    """The bytes the KV cache may take. gpu_memory: a FRACTION (0, 1] of the GPU's total memory the engine may hold
    in all (weights already loaded, a working reserve for a step of max_num_batched_tokens, and the cache), or a
    number of BYTES (> 1) for the cache itself; on CPU a fraction means CPU_KV_BYTES."""
    if isinstance(gpu_memory, bool) or not isinstance(gpu_memory, (int, float)) or not gpu_memory > 0:
        raise GenerationError(f"gpu_memory must be a fraction in (0, 1] or a number of bytes, got {gpu_memory!r}")
    if gpu_memory > 1:
        return int(gpu_memory)
    if device.type == "cuda":
        _, total = torch.cuda.mem_get_info(device)
        return int(gpu_memory * total) - torch.cuda.memory_allocated(device) - working_bytes(
            cfg, max_num_batched_tokens, max_num_seqs, dtype.itemsize)
    return CPU_KV_BYTES


def kv_pool_blocks(cfg: LlamaConfig, device: torch.device, dtype: torch.dtype, block_size: int, budget: int,
                   max_num_seqs: int, gpu_memory=None) -> int:
    """How many blocks the pool gets from `budget` bytes (kv_budget's, less what a vision model keeps for its
    images); never more than max_num_seqs sequences of the model's whole context could use. gpu_memory: named in
    the error when the budget holds no block."""
    per_block = ModelRunner.kv_bytes_per_block(cfg, block_size, dtype)  # the pool holds one spare block more
    most = max_num_seqs * -(-cfg.max_position_embeddings // block_size)
    blocks = min(budget // per_block - 1, most)
    if blocks < 1:
        raise GenerationError(f"gpu_memory={gpu_memory!r} leaves no room for the KV cache on {device} (one block of "
                              f"{block_size} tokens needs {per_block} bytes); raise it")
    return blocks


def working_bytes(cfg: LlamaConfig, tokens: int, seqs: int, element_size: int) -> int:
    """A generous bound on a step's live activations: a few [T, D], the [T, (H+2K)E] and [T, 2F] GEMM outputs, the
    [T, F] activation, one prefill chunk's gathered K/V, and fp32 logits and sampling buffers of [seqs, V]."""
    per_token = 6 * cfg.hidden_size + 2 * (cfg.q_size + 2 * cfg.kv_size) + 4 * cfg.intermediate_size
    gathered = 2 * cfg.kv_size * cfg.max_position_embeddings
    return (tokens * per_token + gathered) * element_size + 8 * seqs * cfg.vocab_size * 4
