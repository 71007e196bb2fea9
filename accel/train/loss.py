"""The loss of the frozen lm_head: linear + cross-entropy fused, loss and dX in one pass over row chunks.

For each chunk of rows: logits = h @ Wᵀ in the model dtype ([rows, V], the only large tensor, one chunk at a time),
then one kernel turns each row into its loss and overwrites the logits with softmax − onehot (never an fp32 copy),
then dh = dlogits @ W. The lm_head is frozen, so there is no dW and nothing is left for the backward but scaling the
saved dh by the incoming gradient: no logits recomputation, no second lm_head GEMM.
Returns the *sum* over label rows (labels == IGNORE carry nothing): the training loop divides by the label count of
the whole optimiser step, so micro-batches accumulate exactly.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from refimpl.train.data import IGNORE

CHUNK_ROWS = 1024  # [rows, V] logits alive at once: 0.25 GiB in bf16 at V = 128256


def cross_entropy_rows_torch(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The row kernel's math in torch (CPU): logits [N, V] overwritten with d loss_n / d logits, -> loss [N] fp32."""
    lf = logits.float()  # upcast, as HF's loss does
    lse = torch.logsumexp(lf, dim=-1)  # [N]
    keep = labels != IGNORE
    safe = torch.where(keep, labels, 0)
    loss = torch.where(keep, lse - lf.gather(1, safe[:, None])[:, 0], 0.0)
    grad = torch.exp(lf - lse[:, None])  # softmax, [N, V]
    grad[torch.arange(len(labels), device=labels.device), safe] -= 1.0
    logits.copy_(grad.masked_fill_(~keep[:, None], 0.0))
    return loss


def _rows_fn(device, use_triton: bool | None):
    if use_triton or (use_triton is None and device.type == "cuda"):
        from accel.kernels.cross_entropy import cross_entropy_rows_
        return lambda logits, labels: cross_entropy_rows_(logits, labels, IGNORE)
    return cross_entropy_rows_torch


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, labels, chunk, rows_fn):
        dh = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for start in range(0, h.shape[0], chunk):
            rows = slice(start, start + chunk)
            logits = F.linear(h[rows], weight)  # [n, D] -> [n, V]
            total += rows_fn(logits, labels[rows]).sum()  # logits now hold d loss / d logits
            if dh is not None:
                torch.matmul(logits, weight, out=dh[rows])  # [n, V] @ [V, D] -> [n, D]
        ctx.save_for_backward(dh)
        return total

    @staticmethod
    def backward(ctx, d_total):
        (dh,) = ctx.saved_tensors
        assert not ctx.needs_input_grad[1], "the lm_head is frozen: no weight gradient is computed"
        return (dh.float() * d_total).to(dh.dtype), None, None, None, None  # 1/n stays fp32


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         chunk: int = CHUNK_ROWS, use_triton: bool | None = None) -> torch.Tensor:
    """h [N, D], weight [V, D] (frozen), labels [N] (IGNORE = no loss) -> Σ over label rows of
    −log softmax(h Wᵀ)[label], fp32 scalar, differentiable in h. The softmax runs on CUDA in the Triton row kernel
    (accel/kernels/cross_entropy.py), elsewhere in torch (`use_triton` forces either)."""
    return _LinearCrossEntropy.apply(h, weight, labels, chunk, _rows_fn(h.device, use_triton))
