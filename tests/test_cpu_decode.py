"""The CPU kernel library (kernels/cpu_decode.cpp): its paged attention against a float64
reference, its batch and thread invariance, what it refuses, and its build; then the int8 LM
head's rows, the 16-bit RMSNorm and rotary, and the KV write, each against torch's own.

The reference is kernels/torch_ref.py's plain attention over the same pool in float64: a
float32 decode lands within float32's rounding of it, a bfloat16 one within one rounding of
its output (the kernel keeps every intermediate in float32).
"""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_decode
from kernels.registry import TorchBackend
from kernels.torch_ref import paged_attention_torch
from kernels.torch_sdpa import paged_attention_sdpa
from tests.test_torch_sdpa import make_batch

TOL = {torch.float32: dict(atol=2e-6, rtol=2e-5), torch.bfloat16: dict(atol=4e-3, rtol=8e-3)}


def reference(batch, scale: float) -> torch.Tensor:
    """Float64 attention over the same pool."""
    query, k, v, tables, qsl, lens = batch
    return paged_attention_torch(query.double(), k.double(), v.double(), tables, qsl, lens, scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (8, 1), (20, 2)], ids=["mha", "gqa", "mqa", "gqa10"])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("block_size", [1, 16])
def test_decodes_match_a_float64_reference(dtype, heads, kv_heads, head_dim, block_size):
    """Decodes of 1 to 1,500 positions, their blocks scattered across the pool."""
    lens = [1, 16, 17, 300, 1500] if block_size > 1 else [1, 17, 300]
    batch = make_batch([1] * len(lens), lens, heads, kv_heads, head_dim, block_size, dtype=dtype, seed=head_dim)
    got = TorchBackend().attention(*batch, scale=head_dim**-0.5)
    assert got.dtype == dtype and got.shape == batch[0].shape
    torch.testing.assert_close(got.double(), reference(batch, head_dim**-0.5), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_rounds_the_same_alone_or_in_any_batch(dtype):
    """The same query over the same blocks gives the same bits alone, among other decodes and
    beside a prefill chunk (float32: the torch path; 16 bits: the kernel, row by row), in any
    position of the batch."""
    backend = TorchBackend()
    mixed = make_batch([5, 1, 1, 9, 1], [40, 700, 33, 9, 120], 9, 3, 64, dtype=dtype, seed=3)
    query, k, v, tables, qsl, lens = mixed
    together = backend.attention(*mixed, scale=0.125)
    for s, row in ((1, 5), (2, 6), (4, 16)):  # (each decode's sequence and query row)
        alone = backend.attention(
            query[row : row + 1],
            k,
            v,
            tables[s : s + 1],
            torch.tensor([0, 1], dtype=torch.int32),
            lens[s : s + 1],
            0.125,
        )
        assert torch.equal(alone[0], together[row])
    torch.testing.assert_close(together.double(), reference(mixed, 0.125), **TOL[dtype])


def test_a_16bit_prefill_row_is_the_decode_of_its_position():
    """In bfloat16 every prefill row goes through the kernel as a decode of the positions it
    sees (the chunk's context and the rows up to itself): each equals that decode bit for bit,
    so a token's K/V is the same whether it was decoded or recomputed in a prefill."""
    backend = TorchBackend()
    context, n = 300, 40
    batch = make_batch([n], [context + n], 9, 3, 64, dtype=torch.bfloat16, seed=13)
    query, k, v, tables, qsl, lens = batch
    chunk = backend.attention(*batch, scale=0.125)
    one = torch.tensor([0, 1], dtype=torch.int32)
    for i in (0, 1, 17, n - 1):
        alone = backend.attention(query[i : i + 1], k, v, tables, one, torch.tensor([context + i + 1]).int(), 0.125)
        assert torch.equal(alone[0], chunk[i])
    torch.testing.assert_close(chunk.double(), reference(batch, 0.125), **TOL[torch.bfloat16])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_threads_split_the_work_not_the_roundings(dtype):
    """A long decode (several spans of the values' partial sums) is attended by every torch
    thread, short ones are spread over them, a prefill's rows too: one thread gives the same
    bits."""
    batch = make_batch([1, 1, 1, 1, 1, 1, 30], [1500, 600, 20, 33, 100, 7, 80], 9, 3, 64, dtype=dtype, seed=11)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = TorchBackend().attention(*batch, scale=0.125)
        torch.set_num_threads(1)
        one = TorchBackend().attention(*batch, scale=0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slots_past_a_decodes_end_are_never_read(dtype):
    """NaN in the slots after each sequence's last position (what an earlier owner left)."""
    lens = [7, 16, 37]
    batch = make_batch([1, 1, 1], lens, 9, 3, 64, dtype=dtype, seed=5)
    want = reference(batch, 0.125)
    _, k, v, tables, _, _ = batch
    for s, n in enumerate(lens):
        last = tables[s, (n - 1) // 16]
        k[last, n % 16 or 16 :] = float("nan")
        v[last, n % 16 or 16 :] = float("nan")
    got = TorchBackend().attention(*batch, scale=0.125)
    assert not got.isnan().any()
    torch.testing.assert_close(got.double(), want, **TOL[dtype])


def test_extreme_scores_stay_finite_and_exact():
    """A query that makes one position's score dwarf the rest (a near one-hot softmax) and
    scores of -1e4 spread (exponents far below float32's): still the reference's answer."""
    batch = make_batch([1, 1], [50, 50], 4, 2, 64, dtype=torch.float32, seed=9)
    query, k, v, tables, _, _ = batch
    query[0] = k[tables[0, 1], 3].repeat_interleave(2, 0) * 40  # (position 19's key, scaled)
    query[1] *= 300
    got = TorchBackend().attention(*batch, scale=0.125)
    assert got.isfinite().all()
    torch.testing.assert_close(got.double(), reference(batch, 0.125), atol=1e-5, rtol=1e-5)


def test_what_the_kernel_does_not_take_goes_through_torch():
    """An 8-bit cache, float16, a head size it was not built for, a query whose heads are not
    side by side: `supports` says no, and the torch path serves."""
    q = torch.zeros(1, 4, 64)
    cache = torch.zeros(2, 16, 2, 64)
    assert cpu_decode.supports(q, cache, cache, quantized=False)
    assert not cpu_decode.supports(q, cache, cache, quantized=True)
    assert not cpu_decode.supports(q.half(), cache.half(), cache.half(), quantized=False)
    assert not cpu_decode.supports(q.bfloat16(), cache, cache, quantized=False)  # (a cache of another dtype)
    assert not cpu_decode.supports(torch.zeros(1, 4, 48), torch.zeros(2, 16, 2, 48), torch.zeros(2, 16, 2, 48), False)
    assert not cpu_decode.supports(torch.zeros(1, 3, 64), cache, cache, quantized=False)  # (3 heads over 2)
    assert not cpu_decode.supports(torch.zeros(1, 64, 4).transpose(1, 2), cache, cache, quantized=False)
    assert not cpu_decode.supports(q, cache, cache[:, :, :1], quantized=False)  # (not a whole cache)


def test_the_scratch_size_is_the_kernels_own():
    """kernels/cpu_decode.py's scratch_size equals the library's layout, for every head size
    it was built for and lengths around the vectors' and the spans' edges."""
    lib = cpu_decode.library()
    for d in cpu_decode.HEAD_DIMS:
        for heads in (1, 9, 17, 32):
            for longest in (1, 15, 16, 17, 255, 256, 257, 4000):
                for threads in (1, 2, 3):
                    want = lib.pagefleet_decode_scratch(d, heads, longest, threads)
                    assert cpu_decode.scratch_size(heads, longest, d, threads) == want


def test_turned_off_the_torch_path_serves(monkeypatch):
    """PAGEFLEET_CPU_DECODE=0: the backend's answer is the torch path's, bit for bit."""
    monkeypatch.setenv("PAGEFLEET_CPU_DECODE", "0")
    assert cpu_decode.library() is None
    batch = make_batch([1], [40], 9, 3, 64, dtype=torch.bfloat16, seed=1)
    assert torch.equal(TorchBackend().attention(*batch, scale=0.125), paged_attention_sdpa(*batch, scale=0.125))


def test_the_build_is_cached_and_a_failed_one_raises(tmp_path, monkeypatch):
    """A second build of the same source finds the first's library; a source that does not
    compile raises with the compiler's message, and leaves no file behind."""
    first = cpu_decode.build(tmp_path)
    stamp = first.stat().st_mtime_ns
    assert cpu_decode.build(tmp_path) == first and first.stat().st_mtime_ns == stamp
    broken = tmp_path / "broken.cpp"
    broken.write_text('extern "C" int pagefleet_decode( {\n')
    monkeypatch.setattr(cpu_decode, "SOURCE", broken)
    with pytest.raises(RuntimeError, match="failed"):
        cpu_decode.build(tmp_path)
    assert sorted(p.name for p in (tmp_path / "kernels").iterdir()) == [first.name]


# ---- the LM head's int8 rows ------------------------------------------------------------


def int8_case(m: int, out_features: int, in_features: int, dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8, generator=g)
    scales = (torch.rand(out_features, generator=g) * 0.02 + 1e-3).to(dtype)
    x = torch.randn(m, in_features, generator=g).to(dtype)
    return x, w, scales


def int8_rows(x, w, scales):
    return cpu_decode.int8_rows(x, w, scales, torch.empty(x.numel() + 16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,out_features,in_features", [(1, 1000, 576), (3, 4099, 64), (17, 160, 1024)])
def test_int8_rows_match_a_float64_reference(dtype, m, out_features, in_features):
    """Output rows not a multiple of 16, several activation rows: within the dtype's rounding
    of x @ (w * scales)^T in float64."""
    x, w, scales = int8_case(m, out_features, in_features, dtype)
    assert cpu_decode.int8_supports(x, w, scales)
    got = int8_rows(x, w, scales)
    want = (x.double() @ w.double().T) * scales.double()
    assert got.dtype == dtype and got.shape == (m, out_features)
    # (float32: sums of up to 1,024 products of ~2.5 each)
    tol = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=8e-3)
    torch.testing.assert_close(got.double(), want, **tol)
    # torch's own int8 kernel (whose float32 sums are less exact than these), to its rounding
    near = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else tol
    torch.testing.assert_close(got, torch.ops.aten._weight_int8pack_mm(x, w, scales), **near)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_int8_row_is_the_same_alone_or_among_others(dtype):
    x, w, scales = int8_case(5, 777, 576, dtype, seed=1)
    together = int8_rows(x, w, scales)
    for r in range(5):
        assert torch.equal(int8_rows(x[r : r + 1], w, scales)[0], together[r])


# ---- RMSNorm in 16 bits ---------------------------------------------------------------------


def test_a_16bit_rms_norm_is_torchs_to_one_rounding_and_the_same_for_each_row():
    """bfloat16 rows, the way transformers computes them (y = bf16(x r), then bf16(y w)): the
    kernel's squares are summed in another order than torch's, so an element may differ by one
    rounding, rarely; a row is the same bits alone or among others; float32 is not taken."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(4)
    x = (torch.randn(70, 576, generator=g) * 3).bfloat16()
    w = (torch.rand(576, generator=g) + 0.5).bfloat16()
    assert cpu_decode.norm_supports(x, w) and not cpu_decode.norm_supports(x.float(), w.float())
    got = cpu_decode.rms_norm(x, w, 1e-5)
    want = F.rms_norm(x, (576,), None, 1e-5).mul_(w)
    ulp = want.float().abs() * 2**-7  # (bfloat16's spacing, at most)
    assert ((got.float() - want.float()).abs() <= ulp).all()
    assert (got != want).float().mean() < 0.01
    for r in (0, 33, 69):
        assert torch.equal(cpu_decode.rms_norm(x[r : r + 1], w, 1e-5)[0], got[r])


# ---- the KV write -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kv_write_puts_each_token_where_the_torch_scatter_does(dtype):
    """Tokens' K and V (views of a fused QKV row, as the model makes them) into their slots,
    -1 skipped: the pools equal the torch scatter's, byte for byte."""
    from kernels.torch_ref import write_kv_torch

    g = torch.Generator().manual_seed(8)
    qkv = torch.randn(7, (9 + 2 * 3) * 64, generator=g).to(dtype)
    k, v = qkv[:, 9 * 64 : 12 * 64].view(7, 3, 64), qkv[:, 12 * 64 :].view(7, 3, 64)
    slots = torch.tensor([5, 17, -1, 40, 41, 0, 63], dtype=torch.int64)
    pools = [torch.zeros(4, 16, 3, 64, dtype=dtype) for _ in range(4)]
    assert cpu_decode.write_kv(k, v, pools[0], pools[1], slots)
    write_kv_torch(k, v, pools[2], pools[3], slots)
    assert torch.equal(pools[0], pools[2]) and torch.equal(pools[1], pools[3]) and pools[0].any()


def test_a_kv_slot_past_the_pool_raises_and_writes_nothing():
    k = torch.randn(2, 3, 64)
    pool_k, pool_v = torch.zeros(4, 16, 3, 64), torch.zeros(4, 16, 3, 64)
    with pytest.raises(IndexError, match="past the pool"):
        cpu_decode.write_kv(k, k, pool_k, pool_v, torch.tensor([3, 64]))
    assert not pool_k.any() and not pool_v.any()
    assert not cpu_decode.write_kv(k, k, pool_k.to(torch.int8), pool_v, torch.tensor([3, 4]))  # (not its kind)


# ---- rotary in 16 bits --------------------------------------------------------------------


def test_16bit_rotary_is_the_torch_rotation_bit_for_bit():
    """Heads of a fused QKV row rotated by the rotation's cos and signed sin: the kernel's
    answer is apply_rotary's torch arithmetic (each product rounded, then the sum), exactly."""
    from worker.model.layers.rotary import apply_rotary

    g = torch.Generator().manual_seed(12)
    qkv = (torch.randn(9, 15 * 64, generator=g) * 4).bfloat16()
    qk = qkv[:, : 12 * 64].view(9, 12, 64)
    angles = torch.rand(9, 1, 64, generator=g) * 6
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    sin[..., :32].neg_()
    got = cpu_decode.rotary(qk, cos, sin)
    want = (qk * cos).add_(qk.roll(32, -1).mul_(sin))
    assert got is not None and torch.equal(got, want)
    assert torch.equal(apply_rotary(qk, cos, sin), want)
    assert cpu_decode.rotary(qk.float(), cos.float(), sin.float()) is None  # (float32: torch's own)
