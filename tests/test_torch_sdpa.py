"""The CPU attention path against the plain reference and against torch's dense SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.registry import TorchBackend
from kernels.torch_ref import paged_attention_torch
from kernels.torch_sdpa import paged_attention_sdpa


def make_batch(q_lens, seq_lens, heads, kv_heads, head_dim=32, block_size=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 3
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    order = torch.randperm(num_blocks, generator=g)  # blocks scattered across the pool
    max_blocks = max(-(-s // block_size) for s in seq_lens)
    tables, used = [], 0
    for s in seq_lens:
        n = -(-s // block_size)
        row = order[used : used + n].tolist()
        used += n
        tables.append(row + [0] * (max_blocks - n))
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(int(qsl[-1]), heads, head_dim, generator=g).to(dtype)
    return (
        query,
        k_cache,
        v_cache,
        torch.tensor(tables, dtype=torch.int32),
        qsl,
        torch.tensor(seq_lens, dtype=torch.int32),
    )


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_mixed_batch_matches_reference(heads, kv_heads, block_size):
    # a fresh prefill, a chunk with cached context, and decodes of various lengths
    batch = make_batch([9, 6, 1, 1, 1], [9, 40, 1, 17, 70], heads, kv_heads, block_size=block_size)
    want = paged_attention_torch(*batch, scale=0.2)
    got = paged_attention_sdpa(*batch, scale=0.2)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_bfloat16_close_to_reference():
    batch = make_batch([12, 1, 1], [20, 33, 5], 8, 2, dtype=torch.bfloat16)
    torch.testing.assert_close(
        paged_attention_sdpa(*batch, scale=0.2),
        paged_attention_torch(*batch, scale=0.2),
        atol=2e-2,
        rtol=2e-2,
    )


def test_prefill_equals_dense_causal_sdpa():
    q_len, heads, kv_heads, d = 37, 8, 2, 32
    query, k_cache, v_cache, tables, qsl, seq_lens = make_batch([q_len], [q_len], heads, kv_heads, head_dim=d)
    got = paged_attention_sdpa(query, k_cache, v_cache, tables, qsl, seq_lens, scale=d**-0.5)
    blocks = tables[0, : -(-q_len // 16)].long()
    k = k_cache[blocks].reshape(-1, kv_heads, d)[:q_len]
    v = v_cache[blocks].reshape(-1, kv_heads, d)[:q_len]
    want = F.scaled_dot_product_attention(
        query.transpose(0, 1)[None],
        k.repeat_interleave(heads // kv_heads, 1).transpose(0, 1)[None],
        v.repeat_interleave(heads // kv_heads, 1).transpose(0, 1)[None],
        is_causal=True,
    )[0].transpose(0, 1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_decode_slices_when_the_gather_budget_is_small(monkeypatch):
    import kernels.torch_sdpa as mod

    monkeypatch.setattr(mod, "_DECODE_GATHER_ELEMS", 1)  # one sequence per slice
    monkeypatch.setattr(mod, "_PER_SEQUENCE_DECODES", 0)  # every decode through the buckets
    batch = make_batch([1, 1, 1, 1], [3, 50, 17, 64], 4, 2)
    torch.testing.assert_close(
        paged_attention_sdpa(*batch, scale=0.3),
        paged_attention_torch(*batch, scale=0.3),
        atol=1e-5,
        rtol=1e-5,
    )


def test_stale_slots_past_the_end_are_never_read():
    """Unused slots of a sequence's last block may hold anything, NaN included."""
    query, k_cache, v_cache, tables, qsl, seq_lens = make_batch([1, 1, 5], [5, 21, 9], 4, 2)
    want = paged_attention_torch(query, k_cache, v_cache, tables, qsl, seq_lens, scale=0.3)
    for s, n in enumerate(seq_lens.tolist()):
        last = tables[s, (n - 1) // 16]
        k_cache[last, n % 16 or 16 :] = float("nan")
        v_cache[last, n % 16 or 16 :] = float("nan")
    got = paged_attention_sdpa(query, k_cache, v_cache, tables, qsl, seq_lens, scale=0.3)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_prefill_tiles_match_reference(dtype):
    """16-bit prefill chunks run in tiles of queries: fresh and with cached context, over more
    than one tile, beside decodes, the output stays within 16-bit rounding of the reference."""
    from kernels.torch_sdpa import _PREFILL_TILE

    long = 2 * _PREFILL_TILE + 21
    batch = make_batch([long, 70, 1, 1], [long, 70 + 45, 33, 90], 8, 2, dtype=dtype)
    got = paged_attention_sdpa(*batch, scale=0.2)
    want = paged_attention_torch(*batch, scale=0.2)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("kernel", ["1", "0"], ids=["cpu-kernel", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_backends_reused_workspace_gives_each_call_its_own_answer(dtype, kernel, monkeypatch):
    """The torch backend gathers K/V (or the CPU kernel keeps its scores) in one scratch buffer
    for all calls: calls of growing, shrinking and again growing sizes each equal the
    reference (nothing stale is read)."""
    monkeypatch.setenv("PAGEFLEET_CPU_DECODE", kernel)
    backend = TorchBackend()
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    shapes = [([1, 1, 30], [40, 90, 30]), ([1, 1], [5, 17]), ([1, 1, 1, 50], [70, 120, 33, 80])]
    for seed, (q_lens, seq_lens) in enumerate(shapes):
        batch = make_batch(q_lens, seq_lens, 8, 2, dtype=dtype, seed=seed)
        want = paged_attention_torch(*batch, scale=0.2)
        torch.testing.assert_close(backend.attention(*batch, scale=0.2), want, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (4, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("seq_len", [1, 16, 37])
def test_a_single_decode_matches_reference_and_reads_nothing_past_its_end(seq_len, heads, kv_heads, dtype):
    """One decode alone (a single stream's step) attends one sequence without padding: its
    output equals the reference, and NaN in the slots past its end is never read."""
    query, k_cache, v_cache, tables, qsl, seq_lens = make_batch([1], [seq_len], heads, kv_heads, dtype=dtype)
    want = paged_attention_torch(query, k_cache, v_cache, tables, qsl, seq_lens, scale=0.3)
    last = tables[0, (seq_len - 1) // 16]
    k_cache[last, seq_len % 16 or 16 :] = float("nan")
    v_cache[last, seq_len % 16 or 16 :] = float("nan")
    got = paged_attention_sdpa(query, k_cache, v_cache, tables, qsl, seq_lens, scale=0.3)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    assert got.shape == query.shape and got.dtype == dtype
    torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_few_decodes_one_by_one_equal_the_bucketed_path(dtype, monkeypatch):
    """Up to _PER_SEQUENCE_DECODES decodes attend one sequence at a time, more go through the
    length buckets: both give the bucketed path's answer, rounding for rounding."""
    import kernels.torch_sdpa as mod

    batch = make_batch([1, 7, 1], [33, 20, 90], 9, 3, dtype=dtype)
    one_by_one = paged_attention_sdpa(*batch, scale=0.125)
    monkeypatch.setattr(mod, "_PER_SEQUENCE_DECODES", 0)
    torch.testing.assert_close(one_by_one, paged_attention_sdpa(*batch, scale=0.125), atol=1e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_single_decode_reuses_its_spread_query_buffer_call_after_call(dtype, monkeypatch):
    """A single decode writes its scaled query into the workspace's kept spread buffer (zeros
    off its KV heads' blocks): call after call on one backend, with other shapes between, each
    answer is what a fresh call without a workspace gives, bit for bit. (The torch path: the
    CPU kernel, which takes these decodes otherwise, is tests/test_cpu_decode.py's.)"""
    monkeypatch.setenv("PAGEFLEET_CPU_DECODE", "0")
    backend = TorchBackend()
    for seed, (heads, kv_heads, seq_len) in enumerate([(9, 3, 40), (9, 3, 17), (4, 1, 33), (9, 3, 300)]):
        batch = make_batch([1], [seq_len], heads, kv_heads, dtype=dtype, seed=seed)
        want = paged_attention_sdpa(*batch, scale=0.125)  # no workspace: a block_diag spread
        assert torch.equal(backend.attention(*batch, scale=0.125), want)
