"""Rotary position embedding, with frequencies from transformers' own RoPE initialisers.

Every RoPE variant transformers knows (default, linear, dynamic, yarn, llama3, ...) is
computed by the same function transformers' LlamaRotaryEmbedding calls, from the checkpoint's
HF config, so scaled variants agree with the reference by construction. Dynamic NTK scaling
only changes frequencies beyond max_position_embeddings, which is the context length we serve,
so its initial (unscaled) frequencies are the ones it would use.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from kernels import cpu_decode


class RotaryEmbedding(nn.Module):
    """positions (T,) -> cos, sin (T, head_dim) float32, each already scaled by the variant's
    attention factor (as transformers does)."""

    def __init__(self, hf_config: Any, head_dim: int):
        super().__init__()
        params = getattr(hf_config, "rope_parameters", None) or {}
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            init_fn = LlamaRotaryEmbedding.compute_default_rope_parameters
        elif rope_type in ROPE_INIT_FUNCTIONS:
            init_fn = ROPE_INIT_FUNCTIONS[rope_type]
        else:
            raise ValueError(
                f"rope_type {rope_type!r} is unknown; choose default or one of {sorted(ROPE_INIT_FUNCTIONS)}"
            )
        inv_freq, attention_scaling = init_fn(hf_config, device=torch.device("cpu"))
        if inv_freq.shape[-1] * 2 != head_dim:
            raise ValueError(
                f"rope_parameters give {inv_freq.shape[-1] * 2} rotary dims but head_dim is "
                f"{head_dim}; partial rotary embeddings are not supported"
            )
        # A plain attribute, not a buffer: module.to(dtype) must not round it to half precision.
        self.inv_freq = inv_freq.float()  # (head_dim / 2,)
        self.attention_scaling = float(attention_scaling)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # (T, d / 2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (T, d)
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling

    def rotation(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (T,) -> cos, signed sin (T, 1, head_dim) in `dtype`, for `apply_rotary`:
        made once per step for every layer and head. The model dtype, as transformers casts
        them; the sin's first half negated (exact), so that rotate_half(x) * sin is
        roll(x) * signed sin."""
        cos, sin = (t.to(dtype).unsqueeze(1) for t in self(positions))  # (T, 1, d)
        half = sin.shape[-1] // 2
        sin[..., :half].neg_()
        return cos, sin


def apply_rotary(
    x: torch.Tensor,  # (T, heads, head_dim)
    cos: torch.Tensor,  # (T, 1, head_dim) in x's dtype (RotaryEmbedding.rotation)
    sin: torch.Tensor,  # (T, 1, head_dim), its first half negated
) -> torch.Tensor:
    """Rotate each head's (first half, second half) pairs by its position's angle:
    x * cos + rotate_half(x) * sin in x's dtype, as transformers computes it (each product
    rounded, then the sum). rotate_half(x) is (-x2, x1): x rolled by half a head is (x2, x1),
    and the sign is in `sin`."""
    out = cpu_decode.rotary(x, cos, sin)  # (bfloat16 on CPU: the same roundings, one call)
    if out is not None:
        return out
    out = x * cos
    return out.add_(x.roll(x.shape[-1] // 2, -1).mul_(sin))
