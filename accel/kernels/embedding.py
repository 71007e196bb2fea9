"""Embedding row gather in Triton: out[t] = table[ids[t]]. One program copies one token's row (or a block of it)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _embedding_kernel(IDS, TABLE, OUT, stride_table, stride_out, D, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < D
    row = tl.load(IDS + t).to(tl.int64)  # int64: row · stride may pass 2^31 for larger vocabularies or widths
    x = tl.load(TABLE + row * stride_table + cols, mask=inside)
    tl.store(OUT + t * stride_out + cols, x, mask=inside)


def embedding_fwd(ids: torch.Tensor, table: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """ids [T] int (device), table [V, D] -> [T, D] in table's dtype. Ids outside [0, V) are the caller's error."""
    (T,), (_, D) = ids.shape, table.shape
    assert table.stride(1) == 1
    out = torch.empty((T, D), dtype=table.dtype, device=table.device) if out is None else out
    BLOCK = min(1024, triton.next_power_of_2(D))
    _embedding_kernel[(T, triton.cdiv(D, BLOCK))](ids, table, out, table.stride(0), out.stride(0), D,
                                                   BLOCK=BLOCK, num_warps=4)
    return out
