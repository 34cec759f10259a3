"""RMSNorm, computed the way transformers' Llama/Qwen RMSNorm computes it (float32 inside)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """x / rms(x) * weight over the last dimension; replicated on every rank."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # transformers: w * (x.float() * rsqrt(mean(x.float() ** 2) + eps)).to(x.dtype). The
        # same roundings in fewer passes: x times the float32 rsqrt is computed in float32
        # and rounded once, into x's dtype, then scaled by the weight in place.
        var = x.to(torch.float32, copy=True).square_().mean(-1, keepdim=True)
        out = torch.mul(x, var.add_(self.eps).rsqrt_(), out=torch.empty_like(x))
        if self.weight.dtype != x.dtype:
            return self.weight * out
        return out.mul_(self.weight)
