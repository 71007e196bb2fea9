"""Many LoRA adapters in one batch, unmerged (accel/kernels/lora_sgmv.py or its torch version, picked by
accel/ops/dispatch.py): y [T, Dout] += scale[a_t] · (x[t] @ A[a_t]ᵀ) @ B[a_t]ᵀ for each row t with an adapter
(a_t >= 0).

`tiles` ([NT, 3] int32, lora_sgmv.segment_tiles -> tiles_tensor) say which rows take which adapter; a step builds
them once on the host, where the scheduler knows each row's request, and every layer's products reuse them."""
from __future__ import annotations

import torch.nn.functional as F

from ..kernels.lora_sgmv import lora_sgmv_fwd
from .dispatch import rows, uses_triton


def lora_sgmv(y, x, lora_a, lora_b, scales, tiles):
    """y [T, Dout] (updated in place and returned), x [T, Din], lora_a [N, R, Din], lora_b [N, Dout, R] in x's
    dtype, scales [N] fp32, tiles [NT, 3] int32."""
    if uses_triton(x):
        return lora_sgmv_fwd(y, rows(x), lora_a, lora_b, scales, tiles)
    return torch_lora_sgmv(y, x, lora_a, lora_b, scales, tiles)


def torch_lora_sgmv(y, x, lora_a, lora_b, scales, tiles):
    """One pair of products a tile: v rounded to the weights' dtype, the second product and the add in fp32, y
    rounded once (the kernel's order)."""
    for start, end, a in tiles.tolist():
        v = F.linear(x[start:end].float(), lora_a[a].float()).to(lora_a.dtype)  # [M, Din] -> [M, R]
        delta = F.linear(v.float(), lora_b[a].float())  # [M, R] -> [M, Dout]
        y[start:end] = (y[start:end].float() + scales[a].float() * delta).to(y.dtype)
    return y
