"""KV-cache write by slot mapping, as a Triton kernel (quantizing into an 8-bit cache).

Layout: see kernels/torch_ref.py (`write_kv_torch` is the reference this file must match) and,
for the 8-bit caches' codes and scales, kernels/kv_quant.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from kernels.kv_quant import MIN_TOKEN_SCALE, QMAX, check_scales, is_per_token

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INT_DTYPES = (torch.int32, torch.int64)
# How the cache holds values (the SCALES constexpr of both kernels): as they are, as codes
# with a scale per token and KV head written beside them, or as codes with one scale per tensor.
NO_SCALES, TOKEN_SCALES, TENSOR_SCALES = 0, 1, 2


@triton.jit
def _round_to_e4m3(y):
    """float32 y (|y| <= 448) rounded to the nearest float8_e4m3 value, ties to even, still
    in float32, so that the cast after it is exact. Adding and taking away 1.5 x 2**23 ulps
    of y's e4m3 binade rounds y to that binade's e4m3 spacing (2**-3 of its power of two;
    2**-9 below 2**-6, the subnormals) with float32's own round-to-nearest-even. (The
    interpreter's float8 cast drops the carry of a mantissa that rounds up.)"""
    bits = y.to(tl.int32, bitcast=True)
    exp = tl.maximum((bits >> 23) & 0xFF, 127 - 6)  # biased float32 exponent
    magic = (((exp + 20) << 23) | (1 << 22)).to(tl.float32, bitcast=True)  # 1.5 x 2**(e + 20)
    r = (tl.abs(y) + magic) - magic
    return tl.where(bits < 0, -r, r)  # the sign bit, so -0.0 stays -0.0 as in torch


@triton.jit
def _quantize(x, scale, QMAX: tl.constexpr, IS_INT: tl.constexpr, out_ty: tl.constexpr):
    """Codes of x / scale, saturated at +-QMAX; integers round half away from zero (the
    cast truncates), floats to nearest even (kernels/kv_quant.py `quantize`)."""
    y = tl.minimum(tl.maximum(x / scale, -QMAX), QMAX)
    if IS_INT:
        y = tl.where(y >= 0, y + 0.5, y - 0.5)
    else:
        y = _round_to_e4m3(y)
    return y.to(out_ty)


@triton.jit
def _write_one(
    src,
    cache,
    scale,
    block,
    offset,
    heads,
    dims,
    mask,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_sb,
    stride_ss,
    NUM_KV_HEADS: tl.constexpr,
    SCALES: tl.constexpr,
    QMAX: tl.constexpr,
    IS_INT: tl.constexpr,
    MIN_SCALE: tl.constexpr,
):
    """Store one token's (heads, head_dim) values `src` into `cache` at (block, offset)."""
    dst = cache + block * stride_cb + offset * stride_cs + heads[:, None] * stride_ch + dims[None, :]
    out_ty = cache.dtype.element_ty
    if SCALES == 0:
        tl.store(dst, src.to(out_ty), mask=mask)
    else:
        x = src.to(tl.float32)
        if SCALES == 1:  # per token and head: absmax / QMAX, rounded to the scale's dtype
            s = (tl.max(tl.abs(x), 1) / QMAX).to(scale.dtype.element_ty).to(tl.float32)
            s = tl.maximum(s, MIN_SCALE)  # (HEADS_PAD,)
            s_ptr = scale + block * stride_sb + offset * stride_ss + heads
            tl.store(s_ptr, s.to(scale.dtype.element_ty), mask=heads < NUM_KV_HEADS)
            tl.store(dst, _quantize(x, s[:, None], QMAX, IS_INT, out_ty), mask=mask)
        else:  # per tensor, fixed
            s = tl.load(scale).to(tl.float32)
            tl.store(dst, _quantize(x, s, QMAX, IS_INT, out_ty), mask=mask)


@triton.jit
def _write_kv_kernel(
    key,
    value,
    key_cache,
    value_cache,
    slot_mapping,
    k_scale,
    v_scale,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_ksb,
    stride_kss,
    stride_vsb,
    stride_vss,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    PAGE: tl.constexpr,
    SCALES: tl.constexpr,
    QMAX: tl.constexpr,
    IS_INT: tl.constexpr,
    MIN_SCALE: tl.constexpr,
):
    """One program per token: copy (or quantize) its (num_kv_heads, head_dim) K and V into
    its slot."""
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping + tok).to(tl.int64)
    if slot < 0:  # padding token
        return
    block = slot // PAGE
    offset = slot % PAGE
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_PAD)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
    # padded lanes read 0: they must not raise a head's absmax
    k = tl.load(key + tok * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask, other=0.0)
    v = tl.load(value + tok * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask, other=0.0)
    _write_one(
        k,
        key_cache,
        k_scale,
        block,
        offset,
        heads,
        dims,
        mask,
        stride_kcb,
        stride_kcs,
        stride_kch,
        stride_ksb,
        stride_kss,
        NUM_KV_HEADS,
        SCALES,
        QMAX,
        IS_INT,
        MIN_SCALE,
    )
    _write_one(
        v,
        value_cache,
        v_scale,
        block,
        offset,
        heads,
        dims,
        mask,
        stride_vcb,
        stride_vcs,
        stride_vch,
        stride_vsb,
        stride_vss,
        NUM_KV_HEADS,
        SCALES,
        QMAX,
        IS_INT,
        MIN_SCALE,
    )


def _check_inputs(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale) -> None:
    """Raise ValueError naming the first argument that breaks the contract."""
    if key_cache.dim() != 4:
        raise ValueError(
            f"key_cache must be (num_blocks, block_size, num_kv_heads, head_dim), got {tuple(key_cache.shape)}"
        )
    if value_cache.shape != key_cache.shape or value_cache.dtype != key_cache.dtype:
        raise ValueError("value_cache must match key_cache in shape and dtype")
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    for name, t in (("key", key), ("value", value)):
        if t.dim() != 3 or t.shape[1:] != (num_kv_heads, head_dim):
            raise ValueError(f"{name} must be (num_tokens, {num_kv_heads}, {head_dim}), got {tuple(t.shape)}")
    if value.shape[0] != key.shape[0]:
        raise ValueError(f"value has {value.shape[0]} tokens, key has {key.shape[0]}")
    if slot_mapping.shape != (key.shape[0],) or slot_mapping.dtype not in _INT_DTYPES:
        raise ValueError(
            f"slot_mapping must be int32/int64 of shape ({key.shape[0]},), "
            f"got {slot_mapping.dtype} {tuple(slot_mapping.shape)}"
        )
    cache_dtypes = (*_DTYPES, *QMAX)
    for name, t, dtypes in (
        ("key", key, _DTYPES),
        ("value", value, _DTYPES),
        ("key_cache", key_cache, cache_dtypes),
        ("value_cache", value_cache, cache_dtypes),
    ):
        if t.dtype not in dtypes:
            raise ValueError(f"{name} dtype {t.dtype} is not one of {dtypes}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim (stride {t.stride(-1)})")
        if t.device != key_cache.device:
            raise ValueError(f"{name} is on {t.device} but key_cache is on {key_cache.device}")
    if slot_mapping.device != key_cache.device:
        raise ValueError(f"slot_mapping is on {slot_mapping.device}, key_cache on {key_cache.device}")
    check_scales(key_cache, k_scale, v_scale)
    if key_cache.device.type != "cuda" and not isinstance(_write_kv_kernel, InterpretedFunction):
        raise ValueError(f"key_cache is on {key_cache.device}: Triton needs CUDA or TRITON_INTERPRET=1")


def write_kv_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Scatter each token's K and V into its slot of the paged pool.

    Same contract as `kernels.torch_ref.write_kv_torch`:
        key, value:               (num_tokens, num_kv_heads, head_dim), any float dtype
        key_cache, value_cache:   (num_blocks, block_size, num_kv_heads, head_dim), a float
                                  dtype or int8 / float8_e4m3fn
        slot_mapping:             (num_tokens,) int32/int64; block_id * block_size + offset,
                                  -1 skips the token (padding)
        k_scale, v_scale:         8-bit caches only: (num_blocks, block_size, num_kv_heads)
                                  float16, written here, or (1,) float32, read here
    K/V are cast to a float cache's dtype, or quantized into an 8-bit one (kernels/kv_quant.py).
    """
    _check_inputs(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    _, page, num_kv_heads, head_dim = key_cache.shape
    mode, (ksb, kss), (vsb, vss) = (
        scales_mode(k_scale),
        scale_strides(k_scale),
        scale_strides(v_scale),
    )
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key_cache if k_scale is None else k_scale,
        value_cache if v_scale is None else v_scale,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        ksb,
        kss,
        vsb,
        vss,
        NUM_KV_HEADS=num_kv_heads,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        HEAD_PAD=triton.next_power_of_2(head_dim),
        PAGE=page,
        SCALES=mode,
        QMAX=QMAX.get(key_cache.dtype, 0.0),
        IS_INT=key_cache.dtype == torch.int8,
        MIN_SCALE=MIN_TOKEN_SCALE,
    )


def scales_mode(scale: torch.Tensor | None) -> int:
    """The SCALES constexpr for a cache whose (k or v) scale is `scale`."""
    if scale is None:
        return NO_SCALES
    return TOKEN_SCALES if is_per_token(scale) else TENSOR_SCALES


def scale_strides(scale: torch.Tensor | None) -> tuple[int, int]:
    """(block, slot) strides of per-token scales; 0 otherwise (the kernels do not use them)."""
    return (scale.stride(0), scale.stride(1)) if scale is not None and is_per_token(scale) else (0, 0)
