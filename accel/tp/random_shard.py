"""Random weights drawn directly as one rank's shard on its device, for benchmarks at real sizes: no checkpoint on
disk, and no tensor is ever made whole (a 90B model's are not, on any rank or the host).

RandomShard is a reader with accel.tp.load.ShardReader's interface (tensor, matrix, spec), so that the same
builders (accel.tp.vision_load.build_vision_shard) assemble it: each tensor at the shape of this rank's slice
(accel.tp.shard.Slice) of the checkpoint shape. Draws as accel.vision.weights.random_vision_weights: norm weights
1 + N(0, 0.1²), tanh gates 0.5, the rest N(0, std²); quantized matrices as codes drawn uniformly with a scale per
row (int8) or group (int4) giving the same std, never through a dense copy.
"""
from __future__ import annotations

import math

import torch

from refimpl.quant.schemes import QuantSpec

from ..quant_ops import QuantTensor

UNIFORM_INT8_STD = 127 / math.sqrt(3)  # std of codes uniform on [-127, 127]
UNIFORM_INT4_STD = 16 / math.sqrt(12)  # std of codes uniform on [0, 15]


class RandomShard:
    def __init__(self, plan, shapes: dict, device, dtype: torch.dtype, spec: QuantSpec | None = None,
                 seed: int = 0, std: float = 0.02):
        """plan: the rank's plan (slice_of); shapes: every checkpoint tensor's whole shape by name."""
        self.plan, self.shapes, self.device, self.dtype, self.spec, self.std = plan, shapes, device, dtype, spec, std
        self.g = torch.Generator(device=device)
        self.g.manual_seed(seed * 1000 + plan.rank)

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of this rank's part of `name`."""
        whole, s = self.shapes[name], self.plan.slice_of(name)
        if s is None:
            return tuple(whole)
        kept = s.rows or s.stop - s.start
        return (kept, whole[1]) if s.dim == 0 else (whole[0], kept)

    def _normal(self, shape, std: float) -> torch.Tensor:
        return torch.randn(shape, device=self.device, dtype=self.dtype, generator=self.g).mul_(std)

    def tensor(self, name: str) -> torch.Tensor:
        shape = self.shape(name)
        if "gate" in name and "proj" not in name and shape == (1,):
            return torch.full(shape, 0.5, device=self.device, dtype=self.dtype)
        if "norm" in name and name.endswith("weight"):
            return self._normal(shape, 0.1).add_(1)
        return self._normal(shape, self.std)

    def matrix(self, names: list[str], key: str):
        shapes = [self.shape(n) for n in names]
        N, K = sum(s[0] for s in shapes), shapes[0][1]
        if self.spec is None:
            return self._normal((N, K), self.std)
        spec = self.spec.for_matrix(key)
        if spec.format == "int8":
            q = torch.randint(-127, 128, (N, K), device=self.device, dtype=torch.int8, generator=self.g)
            scale = torch.full((N, 1), self.std / UNIFORM_INT8_STD, device=self.device, dtype=torch.bfloat16)
            return QuantTensor("int8", 8, K, q, scale, None, K)
        G = spec.group
        q = torch.randint(0, 256, (N, K // 2), device=self.device, dtype=torch.uint8, generator=self.g)
        scale = torch.full((N, -(-K // G)), self.std / UNIFORM_INT4_STD, device=self.device, dtype=torch.bfloat16)
        return QuantTensor("int4", 4, G, q, scale, (-7.5 * scale.float()).to(torch.bfloat16), K)
