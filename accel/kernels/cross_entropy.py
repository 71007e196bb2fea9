"""Cross-entropy rows in Triton: loss and d loss / d logits of each row in one kernel, the gradient written over the
logits in place (Liger's trick: the [N, V] logits of a chunk are read twice and written once, never copied to fp32).

Row n with label y: loss = logsumexp(x) − x[y] (x upcast to fp32, as HF's loss does); gradient softmax(x) − onehot(y),
rounded to the logits' dtype. A row labelled `ignore_index` has loss 0 and gradient 0. One program = one row,
looping over V in blocks: an online max / sum pass, then the write pass.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _ce_rows_kernel(LOGITS, LABELS, LOSS, stride_l, V, ignore_index, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = LOGITS + row * stride_l
    label = tl.load(LABELS + row).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    if label == ignore_index:
        for v0 in range(0, V, BLOCK):
            tl.store(base + v0 + cols, tl.zeros([BLOCK], dtype=tl.float32).to(LOGITS.dtype.element_ty),
                     mask=v0 + cols < V)
        tl.store(LOSS + row, 0.0)
    else:
        # running max per lane starts finite, so a lane past V (x = -inf) adds exp(-inf) = 0 and never a nan
        m = tl.full([BLOCK], -1e30, dtype=tl.float32)
        s = tl.zeros([BLOCK], dtype=tl.float32)  # running sum of exp(x - m) per lane
        for v0 in range(0, V, BLOCK):
            x = tl.load(base + v0 + cols, mask=v0 + cols < V, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, x)
            s = s * tl.exp(m - m_new) + tl.exp(x - m_new)
            m = m_new
        m_row = tl.max(m, axis=0)
        lse = m_row + tl.log(tl.sum(s * tl.exp(m - m_row), axis=0))
        x_label = tl.load(base + label).to(tl.float32)
        tl.store(LOSS + row, lse - x_label)
        for v0 in range(0, V, BLOCK):
            inside = v0 + cols < V
            x = tl.load(base + v0 + cols, mask=inside, other=0.0).to(tl.float32)
            p = tl.exp(x - lse)
            p = tl.where(v0 + cols == label, p - 1.0, p)
            tl.store(base + v0 + cols, p.to(LOGITS.dtype.element_ty), mask=inside)


def cross_entropy_rows_(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """logits [N, V] (rows contiguous; overwritten with d loss_n / d logits), labels [N] int -> loss [N] fp32."""
    N, V = logits.shape
    assert logits.stride(1) == 1 and labels.shape == (N,), "logits [N, V] with contiguous rows, labels [N]"
    loss = torch.empty(N, dtype=torch.float32, device=logits.device)
    # 4096 columns x 8 warps: 16 values a thread per block, 32 blocks a row at V = 128256
    BLOCK = min(4096, triton.next_power_of_2(V))
    _ce_rows_kernel[(N,)](logits, labels, loss, logits.stride(0), V, ignore_index, BLOCK=BLOCK,
                          num_warps=8 if BLOCK >= 2048 else 4)
    return loss
