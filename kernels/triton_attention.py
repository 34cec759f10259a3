"""The Triton attention backend: paged attention and KV writes as Triton kernels.

Importing this module registers `TritonBackend` under the name "triton". The kernels live
in kernels/triton_paged_attention.py and kernels/triton_write_kv.py; each matches its plain
torch reference in kernels/torch_ref.py.
"""

from __future__ import annotations

import torch

from kernels.registry import AttentionBackend, register_backend
from kernels.triton_paged_attention import choose_num_splits, paged_attention_triton
from kernels.triton_write_kv import write_kv_triton

__all__ = ["TritonBackend", "choose_num_splits", "paged_attention_triton", "write_kv_triton"]


@register_backend
class TritonBackend(AttentionBackend):
    """Triton kernels on CUDA (or on CPU under TRITON_INTERPRET=1, for tests)."""

    name = "triton"

    def write_kv(self, key, value, key_cache, value_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
        write_kv_triton(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)

    def attention(
        self,
        query,
        key_cache,
        value_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        scale,
        out=None,
        k_scale=None,
        v_scale=None,
    ) -> torch.Tensor:
        return paged_attention_triton(
            query,
            key_cache,
            value_cache,
            block_tables,
            query_start_loc,
            seq_lens,
            scale,
            out,
            k_scale,
            v_scale,
        )
