"""8-bit KV caches: what a code means, and the plain-torch quantize and dequantize.

An 8-bit cache (int8 or float8_e4m3fn) holds codes; the value a code stands for is
`code x scale`. The scale tensor beside the cache says its granularity by its shape:

- per token and KV head, (num_blocks, block_size, num_kv_heads) float16: computed when the
  token is written, scale = absmax over head_dim / QMAX, so no value ever saturates. int8's
  layout: 2 bytes per token and head beside head_dim bytes of codes.
- per tensor, (1,) float32: one scale for a layer's K (or V) on this device, fixed before any
  write; values beyond QMAX x scale saturate. float8's layout: the format's exponent keeps the
  relative error the same across the range, so one scale only has to place the range.

Every attention path and write path (torch reference, CPU SDPA, Triton) follows these
definitions; the Triton kernels round exactly as `quantize` does, so their codes are equal.
"""

from __future__ import annotations

import torch

INT8_MAX = 127.0
FP8_E4M3 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_E4M3).max)  # 448
QMAX = {torch.int8: INT8_MAX, FP8_E4M3: FP8_MAX}
TOKEN_SCALE_DTYPE = torch.float16
TENSOR_SCALE_DTYPE = torch.float32
# The smallest per-token scale: float16's smallest normal. A head whose absmax is below
# 127 x this (~0.008) is coded with a coarser step than it could be, never with scale 0.
MIN_TOKEN_SCALE = float(torch.finfo(TOKEN_SCALE_DTYPE).tiny)


def is_quantized(dtype: torch.dtype) -> bool:
    """True for the 8-bit cache dtypes, whose elements are codes with a scale."""
    return dtype in QMAX


def is_per_token(scale: torch.Tensor) -> bool:
    """True for per-token-and-head scales (num_blocks, block_size, num_kv_heads)."""
    return scale.dim() == 3


def token_scales(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(..., num_kv_heads) float16 scales of x (..., num_kv_heads, head_dim) for cache `dtype`."""
    amax = x.float().abs().amax(dim=-1)
    return (amax / QMAX[dtype]).to(TOKEN_SCALE_DTYPE).clamp_min(MIN_TOKEN_SCALE)


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Codes of x (..., head_dim) in `dtype`; `scale` is (...) per token and head or (1,).

    int8 rounds half away from zero (what the Triton kernel's float-to-int cast of
    y +- 0.5 gives); float8 rounds to nearest even. Both saturate at +-QMAX."""
    s = scale.float()
    if s.dim() == x.dim() - 1:
        s = s.unsqueeze(-1)
    qmax = QMAX[dtype]
    y = (x.float() / s).clamp(-qmax, qmax)
    if dtype == torch.int8:
        return (y + torch.where(y >= 0, 0.5, -0.5)).to(torch.int8)  # the cast truncates
    return y.to(dtype)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """codes (..., head_dim) x scale, in `dtype`; `scale` is (...) per token and head or (1,)."""
    s = scale.to(dtype)
    if s.dim() == codes.dim() - 1:
        s = s.unsqueeze(-1)
    if codes.dtype != FP8_E4M3:
        return codes.to(dtype).mul_(s)
    # Not torch's own float8 cast, which is slow on CPU: an e4m3 code's bits, moved
    # into a float16's (the sign, then exponent and mantissa one bit lower: the widening copies
    # the sign into bit 14, which is cleared), are the same number x 2**-8 (exponent bias 15
    # against 7), subnormals included; NaN codes are never written (writes saturate).
    half = codes.view(torch.int8).to(torch.int16).bitwise_left_shift_(7).bitwise_and_(-16385)
    return half.view(torch.float16).to(dtype).mul_(s * 256.0)


def gather_scale(scale: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """The scales of `blocks` (n,) as (n, block_size, num_kv_heads), or the per-tensor scale."""
    return scale.index_select(0, blocks) if is_per_token(scale) else scale


def write_quantized(
    x: torch.Tensor,  # (n, num_kv_heads, head_dim) of the valid tokens
    cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim) int8 / float8
    scale: torch.Tensor,  # per token and head, or (1,)
    slots: torch.Tensor,  # (n,) int64
) -> None:
    """Quantize x into its slots; per-token scales are computed and written beside it."""
    num_blocks, block_size, kvh, d = cache.shape
    if is_per_token(scale):
        s = token_scales(x, cache.dtype)  # (n, kvh)
        scale.view(num_blocks * block_size, kvh).index_copy_(0, slots, s.to(scale.dtype))
    else:
        s = scale
    codes = quantize(x, s, cache.dtype)
    # index_copy_ has no float8 kernel on CPU: copy the bytes
    flat = cache.view(torch.uint8).view(num_blocks * block_size, kvh, d)
    flat.index_copy_(0, slots, codes.view(torch.uint8))


def check_scales(key_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> None:
    """Raise ValueError naming k_scale / v_scale when they do not fit the cache: None for a
    float cache; for an 8-bit one, float16/float32 of shape (num_blocks, block_size,
    num_kv_heads), contiguous in its last dimension, or a single value."""
    if not is_quantized(key_cache.dtype):
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"k_scale/v_scale are for 8-bit caches, not {key_cache.dtype}")
        return
    token_shape = tuple(key_cache.shape[:3])
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is None:
            raise ValueError(f"{name} is required with a {key_cache.dtype} cache")
        shape_ok = tuple(s.shape) == token_shape or (s.dim() == 1 and s.numel() == 1)
        if not shape_ok or s.dtype not in (torch.float16, torch.float32):
            raise ValueError(
                f"{name} must be float16/float32 of shape {token_shape} (per token and head) "
                f"or (1,) (per tensor), got {s.dtype} {tuple(s.shape)}"
            )
        if s.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
        if s.device != key_cache.device:
            raise ValueError(f"{name} is on {s.device} but key_cache is on {key_cache.device}")
    if is_per_token(k_scale) != is_per_token(v_scale):
        raise ValueError("k_scale and v_scale must have the same granularity")
