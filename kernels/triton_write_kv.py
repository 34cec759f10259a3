"""KV-cache write by slot mapping, as a Triton kernel.

Layout: see kernels/torch_ref.py (`write_kv_torch` is the reference this file must match).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INT_DTYPES = (torch.int32, torch.int64)


@triton.jit
def _write_kv_kernel(
    key, value, key_cache, value_cache, slot_mapping,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, PAGE: tl.constexpr,
):  # fmt: skip
    """One program per token: copy its (num_kv_heads, head_dim) K and V into its slot."""
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping + tok).to(tl.int64)
    if slot < 0:  # padding token
        return
    block = slot // PAGE
    offset = slot % PAGE
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_PAD)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
    k = tl.load(key + tok * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(value + tok * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    k_dst = key_cache + block * stride_kcb + offset * stride_kcs + heads[:, None] * stride_kch
    v_dst = value_cache + block * stride_vcb + offset * stride_vcs + heads[:, None] * stride_vch
    tl.store(k_dst + dims[None, :], k.to(key_cache.dtype.element_ty), mask=mask)
    tl.store(v_dst + dims[None, :], v.to(value_cache.dtype.element_ty), mask=mask)


def _check_inputs(key, value, key_cache, value_cache, slot_mapping) -> None:
    """Raise ValueError naming the first argument that breaks the contract."""
    if key_cache.dim() != 4:
        raise ValueError(
            "key_cache must be (num_blocks, block_size, num_kv_heads, head_dim), "
            f"got {tuple(key_cache.shape)}"
        )
    if value_cache.shape != key_cache.shape or value_cache.dtype != key_cache.dtype:
        raise ValueError("value_cache must match key_cache in shape and dtype")
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    for name, t in (("key", key), ("value", value)):
        if t.dim() != 3 or t.shape[1:] != (num_kv_heads, head_dim):
            raise ValueError(
                f"{name} must be (num_tokens, {num_kv_heads}, {head_dim}), got {tuple(t.shape)}"
            )
    if value.shape[0] != key.shape[0]:
        raise ValueError(f"value has {value.shape[0]} tokens, key has {key.shape[0]}")
    if slot_mapping.shape != (key.shape[0],) or slot_mapping.dtype not in _INT_DTYPES:
        raise ValueError(
            f"slot_mapping must be int32/int64 of shape ({key.shape[0]},), "
            f"got {slot_mapping.dtype} {tuple(slot_mapping.shape)}"
        )
    for name, t in (
        ("key", key),
        ("value", value),
        ("key_cache", key_cache),
        ("value_cache", value_cache),
    ):
        if t.dtype not in _DTYPES:
            raise ValueError(f"{name} dtype {t.dtype} is not one of {_DTYPES}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim (stride {t.stride(-1)})")
        if t.device != key_cache.device:
            raise ValueError(f"{name} is on {t.device} but key_cache is on {key_cache.device}")
    if slot_mapping.device != key_cache.device:
        raise ValueError(
            f"slot_mapping is on {slot_mapping.device}, key_cache on {key_cache.device}"
        )
    if key_cache.device.type != "cuda" and not isinstance(_write_kv_kernel, InterpretedFunction):
        raise ValueError(
            f"key_cache is on {key_cache.device}: Triton needs CUDA or TRITON_INTERPRET=1"
        )


def write_kv_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter each token's K and V into its slot of the paged pool.

    Same contract as `kernels.torch_ref.write_kv_torch`:
        key, value:               (num_tokens, num_kv_heads, head_dim), any float dtype
        key_cache, value_cache:   (num_blocks, block_size, num_kv_heads, head_dim)
        slot_mapping:             (num_tokens,) int32/int64; block_id * block_size + offset,
                                  -1 skips the token (padding)
    K/V are cast to the cache dtype on the way in.
    """
    _check_inputs(key, value, key_cache, value_cache, slot_mapping)
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    _, page, num_kv_heads, head_dim = key_cache.shape
    _write_kv_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim, HEAD_PAD=triton.next_power_of_2(head_dim), PAGE=page,
    )  # fmt: skip
