"""RMSNorm, computed the way transformers' Llama/Qwen RMSNorm computes it (float32 inside)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels import cpu_decode


class RMSNorm(nn.Module):
    """x / rms(x) * weight over the last dimension; replicated on every rank."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.normalized_shape = (size,)
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_decode.norm_supports(x, self.weight):  # bfloat16 on CPU: one call, not ten ops
            return cpu_decode.rms_norm(x, self.weight, self.eps)
        # transformers: w * (x.float() * rsqrt(mean(x.float() ** 2) + eps)).to(x.dtype).
        # torch's rms_norm without a weight computes the same in float32 and rounds once into
        # x's dtype (bit for bit, tests/test_models.py); the weight then scales it in place.
        out = F.rms_norm(x, self.normalized_shape, None, self.eps)
        if self.weight.dtype != x.dtype:
            return self.weight * out
        return out.mul_(self.weight)
