"""Paged attention for one layer: write this step's K/V into the pool, then attend over it."""

from __future__ import annotations

import torch
from torch import nn

from kernels.registry import AttentionBackend, get_backend
from worker.model.attention_metadata import AttentionMetadata


class PagedAttention(nn.Module):
    """Causal attention of a flat batch over its sequences' paged K/V (this rank's heads).

    The KV pool binds this layer's caches with `bind_kv_cache`, each of shape
    (num_blocks, block_size, num_kv_heads, head_dim) for this rank's KV heads, and an 8-bit
    cache's scales (kernels/kv_quant.py). They are plain attributes, not buffers: they belong
    to the pool, not to the model's state dict.
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        backend: AttentionBackend | None = None,
    ):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.backend = backend or get_backend("torch")
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None

    def set_backend(self, backend: AttentionBackend) -> None:
        self.backend = backend

    def bind_kv_cache(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> None:
        """Use these pool tensors, (num_blocks, block_size, num_kv_heads, head_dim), as K/V;
        an 8-bit cache comes with its scales."""
        expected = (self.num_kv_heads, self.head_dim)
        for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
            if cache.dim() != 4 or tuple(cache.shape[2:]) != expected:
                raise ValueError(
                    f"{name} must be (num_blocks, block_size, {expected[0]}, {expected[1]}), got {tuple(cache.shape)}"
                )
        if k_cache.shape != v_cache.shape:
            raise ValueError(f"k_cache {tuple(k_cache.shape)} != v_cache {tuple(v_cache.shape)}")
        self.k_cache, self.v_cache = k_cache, v_cache
        self.k_scale, self.v_scale = k_scale, v_scale

    def forward(
        self,
        q: torch.Tensor,  # (T, num_heads, head_dim)
        k: torch.Tensor,  # (T, num_kv_heads, head_dim)
        v: torch.Tensor,  # (T, num_kv_heads, head_dim)
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # (T, num_heads, head_dim)
        if self.k_cache is None or self.v_cache is None:
            raise RuntimeError(
                "PagedAttention has no KV cache: the KV pool must call bind_kv_cache() on every "
                "layer (model.attention_layers()) before the first forward"
            )
        ks, vs = self.k_scale, self.v_scale
        self.backend.write_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping, ks, vs)
        return self.backend.attention(
            q,
            self.k_cache,
            self.v_cache,
            meta.block_tables,
            meta.query_start_loc,
            meta.seq_lens,
            self.scale,
            k_scale=ks,
            v_scale=vs,
        )
