"""Floor 1, 8-bit KV caches: the quantizer's bounds, and every write and attention path on int8
and float8 caches against the torch reference, and the reference against torch's SDPA over
the dequantized K/V. Without CUDA the Triton kernels run in Triton's interpreter: tiny sizes.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel modules are imported

import pytest  # noqa: E402
from test_kernels import ATOL, DEVICE, make_batch, sdpa_reference  # noqa: E402

from kernels.kv_quant import (  # noqa: E402
    FP8_E4M3,
    INT8_MAX,
    MIN_TOKEN_SCALE,
    dequantize,
    quantize,
    token_scales,
)
from kernels.registry import TorchBackend  # noqa: E402
from kernels.torch_ref import paged_attention_torch, write_kv_torch  # noqa: E402
from kernels.torch_sdpa import paged_attention_sdpa  # noqa: E402
from kernels.triton_attention import (  # noqa: E402
    TritonBackend,
    paged_attention_triton,
    write_kv_triton,
)

# the layouts the pool uses, and the crossed ones the kernels also take
LAYOUTS = {"int8_token": (torch.int8, True), "fp8_tensor": (FP8_E4M3, False)}
CROSSED = {"int8_tensor": (torch.int8, False), "fp8_token": (FP8_E4M3, True)}


def new_scales(cache: torch.Tensor, per_token: bool, value: float = 0.05) -> torch.Tensor:
    """Scales for `cache`: float16 per token and head (to be written), or one float32."""
    if per_token:
        return torch.zeros(cache.shape[:3], dtype=torch.float16, device=cache.device)
    return torch.tensor([value], device=cache.device)


def quantized_batch(q_lens, seq_lens, heads, kv_heads, head_dim, page, dtype, layout, seed=0):
    """make_batch's float pool written into an 8-bit pool by the reference write path.
    Returns (query, k8, v8, table, starts, lens, scale, k_scale, v_scale)."""
    cache_dtype, per_token = {**LAYOUTS, **CROSSED}[layout]
    query, k, v, table, starts, lens, scale = make_batch(q_lens, seq_lens, heads, kv_heads, head_dim, page, dtype, seed)
    k8, v8 = (torch.empty(k.shape, dtype=cache_dtype, device=DEVICE) for _ in range(2))
    k_scale, v_scale = new_scales(k8, per_token, 0.02), new_scales(v8, per_token, 0.01)
    slots = torch.arange(k.shape[0] * page, device=DEVICE)
    flat = (t.reshape(-1, kv_heads, head_dim) for t in (k, v))
    write_kv_torch(*flat, k8, v8, slots, k_scale, v_scale)
    return query, k8, v8, table, starts, lens, scale, k_scale, v_scale


def round_trip(x: torch.Tensor, dtype: torch.dtype, tensor_scale: torch.Tensor | None):
    """x as an 8-bit cache gives it back: per token and head, or with `tensor_scale`."""
    s = token_scales(x, dtype) if tensor_scale is None else tensor_scale
    return dequantize(quantize(x, s, dtype), s)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    as_bytes = (lambda t: t.view(torch.uint8)) if a.dtype == FP8_E4M3 else (lambda t: t)
    return torch.equal(as_bytes(a), as_bytes(b))


# ---- the quantizer ------------------------------------------------------------------------
def test_int8_per_token_round_trip_is_within_half_a_step():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, 80, generator=g) * torch.logspace(-3, 2, 64)[:, None, None]
    x[5, 2] = 0.0  # a head of zeros: scale at its floor, codes 0
    s = token_scales(x, torch.int8)  # (64, 4)
    assert s.dtype == torch.float16 and s.min() == MIN_TOKEN_SCALE
    torch.testing.assert_close(s.float(), (x.abs().amax(-1) / INT8_MAX).clamp_min(MIN_TOKEN_SCALE), rtol=1e-3, atol=0)
    codes = quantize(x, s, torch.int8)
    err = (dequantize(codes, s) - x).abs()
    assert torch.all(err <= s.float()[..., None] * (0.5 + 1e-3))
    big = x.abs().amax(-1) > INT8_MAX * MIN_TOKEN_SCALE
    assert torch.all(codes.abs().amax(-1)[big] >= 126)  # the range is used
    assert torch.equal(codes[5, 2], torch.zeros(80, dtype=torch.int8))
    again = dequantize(codes, s)  # re-quantizing what a cache holds changes nothing
    assert torch.equal(quantize(again, token_scales(again, torch.int8), torch.int8), codes)


def test_fp8_per_tensor_round_trip_bounds_and_saturation():
    g = torch.Generator().manual_seed(1)
    scale = torch.tensor([0.25])
    x = torch.randn(4096, generator=g) * torch.logspace(-4, 2.6, 4096)
    codes = quantize(x, scale, FP8_E4M3)
    assert codes.dtype == FP8_E4M3
    back = dequantize(codes, scale)
    y = (x / scale).abs()
    normal = (y >= 2**-6) & (y <= 448)
    assert torch.all((back - x).abs()[normal] <= 2**-4 * x.abs()[normal] + 1e-9)
    sub = y < 2**-6  # subnormals: a fixed step of 2**-9 scale units
    assert torch.all((back - x).abs()[sub] <= 2**-10 * scale + 1e-12)
    over = y > 448
    assert over.any() and torch.equal(back[over], torch.sign(x[over]) * 448 * scale)


# ---- writes: Triton against the reference, byte for byte --------------------------------
@pytest.mark.parametrize("layout", [*LAYOUTS, *CROSSED])
def test_write_kv_quantized_matches_reference(layout):
    cache_dtype, per_token = {**LAYOUTS, **CROSSED}[layout]
    g = torch.Generator().manual_seed(2)
    num_tokens, kv_heads, head_dim, num_blocks, page = 7, 3, 80, 8, 16
    key = (torch.randn(num_tokens, kv_heads, head_dim, generator=g) * 4).to(DEVICE)
    value = torch.randn(num_tokens, kv_heads, head_dim, generator=g).to(DEVICE)
    key[2, 1] = 0.0
    key[3, 0, :4] = torch.tensor([1e4, -1e4, 1e-6, -0.0])  # saturates (per tensor), underflows
    cache = torch.zeros(num_blocks, page, kv_heads, head_dim, dtype=cache_dtype, device=DEVICE)
    slots = torch.randperm(num_blocks * page, generator=g)[:num_tokens].to(torch.int32)
    slots[[1, 4]] = -1  # padding tokens: must leave codes and scales untouched
    slots = slots.to(DEVICE)
    scales = new_scales(cache, per_token)
    if per_token:
        scales.fill_(7.0)  # stale scales stay where nobody writes
    want = [cache.clone(), cache.clone(), scales.clone(), scales.clone()]
    got = [cache.clone(), cache.clone(), scales.clone(), scales.clone()]
    write_kv_torch(key, value, want[0], want[1], slots, want[2], want[3])
    write_kv_triton(key, value, got[0], got[1], slots, got[2], got[3])
    assert all(same_bytes(a, b) for a, b in zip(want, got, strict=True))
    if per_token:
        assert (want[2] != 7.0).sum() == (num_tokens - 2) * kv_heads


# ---- attention: Triton and SDPA against the reference -----------------------------------
# name: (q_lens, seq_lens, num_heads, num_kv_heads, head_dim, page, dtype, layout, num_splits)
CASES = {
    "int8_decode": ([1, 1, 1], [5, 70, 17], 4, 2, 64, 16, torch.float32, "int8_token", 1),
    "int8_mixed_gqa4": ([1, 9, 1, 24], [33, 30, 70, 24], 8, 2, 64, 16, torch.float32, "int8_token", 1),
    "int8_mqa_page32": ([2, 1, 5], [40, 70, 5], 4, 1, 64, 32, torch.float32, "int8_token", 1),
    "int8_bf16_split": ([1, 1], [150, 40], 8, 2, 64, 16, torch.bfloat16, "int8_token", 3),
    "fp8_mixed_gqa4": ([1, 9, 1, 24], [33, 30, 70, 24], 8, 2, 64, 16, torch.float32, "fp8_tensor", 1),
    "fp8_mqa_page32_fp16": ([2, 1, 5], [40, 70, 5], 4, 1, 64, 32, torch.float16, "fp8_tensor", 1),
    "fp8_split_hd80": ([1, 9], [140, 30], 4, 1, 80, 16, torch.float32, "fp8_tensor", 2),
    "int8_tensor_crossed": ([1, 7], [20, 7], 4, 2, 64, 16, torch.float32, "int8_tensor", 1),
    "fp8_token_crossed": ([1, 7], [20, 7], 4, 2, 64, 32, torch.float32, "fp8_token", 1),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_triton_attention_on_8bit_caches_matches_reference(case):
    *shape, layout, num_splits = case
    query, k8, v8, table, starts, lens, scale, ks, vs = quantized_batch(*shape, layout)
    args = (query, k8, v8, table, starts, lens, scale)
    expected = paged_attention_torch(*args, k_scale=ks, v_scale=vs)
    got = paged_attention_triton(*args, k_scale=ks, v_scale=vs, num_splits=num_splits)
    dtype = query.dtype
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), expected.float(), atol=ATOL[dtype], rtol=0)


@pytest.mark.parametrize("per_sequence", [8, 0], ids=["decodes_one_by_one", "decodes_bucketed"])
@pytest.mark.parametrize("layout", [*LAYOUTS, *CROSSED])
@pytest.mark.parametrize("page", [16, 32])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
def test_sdpa_path_on_8bit_caches_matches_reference(heads, kv_heads, page, layout, per_sequence, monkeypatch):
    import kernels.torch_sdpa as mod

    monkeypatch.setattr(mod, "_PER_SEQUENCE_DECODES", per_sequence)
    shape = ([9, 6, 1, 1, 1], [9, 40, 1, 17, 70], heads, kv_heads, 32, page, torch.float32)
    query, k8, v8, table, starts, lens, scale, ks, vs = quantized_batch(*shape, layout)
    args = (query, k8, v8, table, starts, lens, scale)
    want = paged_attention_torch(*args, k_scale=ks, v_scale=vs)
    got = paged_attention_sdpa(*args, k_scale=ks, v_scale=vs)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", [TorchBackend(), TritonBackend()], ids=["torch", "triton"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_backend_on_8bit_cache_equals_sdpa_over_dequantized_kv(backend, layout):
    """Dense K/V written through the backend, read back by its attention: torch's own SDPA
    over the same K/V quantized and dequantized gives the same output."""
    cache_dtype, per_token = LAYOUTS[layout]
    g = torch.Generator().manual_seed(3)
    q_lens, ctx_lens, heads, kv_heads, d, page = [6, 1, 1], [21, 40, 0], 8, 2, 32, 16
    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens, strict=True)]
    query, k, _, table, starts, lens, scale = make_batch(q_lens, seq_lens, heads, kv_heads, d, page)
    k8, v8 = torch.zeros_like(k, dtype=cache_dtype), torch.zeros_like(k, dtype=cache_dtype)
    ks, vs = new_scales(k8, per_token, 0.02), new_scales(v8, per_token, 0.01)
    dense, keys, values, slots = [], [], [], []
    for s, n in enumerate(seq_lens):
        kk, vv = (torch.randn(n, kv_heads, d, generator=g).to(DEVICE) for _ in range(2))
        pos = torch.arange(n, device=DEVICE)
        slots.append(table[s, pos // page].long() * page + pos % page)
        keys.append(kk)
        values.append(vv)
        kq, vq = (round_trip(x, cache_dtype, None if per_token else t) for x, t in ((kk, ks), (vv, vs)))
        dense.append((query[starts[s] : starts[s + 1]], kq, vq))
    backend.write_kv(torch.cat(keys), torch.cat(values), k8, v8, torch.cat(slots), ks, vs)
    got = backend.attention(query, k8, v8, table, starts, lens, scale, k_scale=ks, v_scale=vs)
    torch.testing.assert_close(got, sdpa_reference(dense, scale), atol=2e-5, rtol=1e-5)


def test_8bit_inputs_are_checked_naming_the_scale():
    query, k8, v8, table, starts, lens, scale, ks, vs = quantized_batch(
        [1, 2], [5, 2], 4, 2, 64, 16, torch.float32, "int8_token"
    )
    args = (query, k8, v8, table, starts, lens, scale)
    with pytest.raises(ValueError, match="k_scale is required"):
        paged_attention_triton(*args)
    with pytest.raises(ValueError, match="v_scale must be"):
        paged_attention_triton(*args, k_scale=ks, v_scale=vs[:-1])
    with pytest.raises(ValueError, match="same granularity"):
        paged_attention_triton(*args, k_scale=ks, v_scale=torch.ones(1, device=DEVICE))
    with pytest.raises(ValueError, match="value_cache dtype"):
        paged_attention_triton(query, k8, v8.view(FP8_E4M3), *args[3:], k_scale=ks, v_scale=vs)
    kv = torch.zeros(3, 2, 64, device=DEVICE)
    floats = torch.zeros(2, 16, 2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="8-bit caches"):
        write_kv_triton(kv, kv, floats, floats.clone(), torch.zeros(3, dtype=torch.int32), ks, vs)
