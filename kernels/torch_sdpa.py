"""The CPU path: paged attention in plain torch built on fused kernels.

Same signature and semantics as `kernels.torch_ref.paged_attention_torch` (the reference it is
tested against), but fast enough to serve from: decodes (one query token per sequence) are
grouped by context length, gathered per group and attended in one fused
`torch.nn.functional.scaled_dot_product_attention` call with a padding mask; prefill chunks run
through the same fused call per sequence, causal against their cached context. An 8-bit
cache is dequantized (code x scale, kernels/kv_quant.py) into the query's dtype as it is
gathered, so the fused call sees the same float K/V as with a 16-bit cache.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from kernels.kv_quant import dequantize, gather_scale

# Padded K/V of a decode batch is gathered in groups of at most this many elements, so that a
# batch of long contexts does not double the memory of the pool it reads.
_DECODE_GATHER_ELEMS = 1 << 24


class _Pool(NamedTuple):
    """One layer's K/V caches and, for an 8-bit cache, their scales."""

    key: torch.Tensor  # (num_blocks, block_size, num_kv_heads, head_dim)
    value: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None

    def gather(self, blocks: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """K and V of `blocks` (n,), (n, block_size, kvh, d) copies in `dtype`."""
        k, v = self.key.index_select(0, blocks), self.value.index_select(0, blocks)
        if self.k_scale is None:
            return k.to(dtype), v.to(dtype)
        k = dequantize(k, gather_scale(self.k_scale, blocks), dtype)
        return k, dequantize(v, gather_scale(self.v_scale, blocks), dtype)


def paged_attention_sdpa(
    query: torch.Tensor,  # (num_tokens, num_heads, head_dim)
    key_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    value_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    block_tables: torch.Tensor,  # (num_seqs, max_blocks_per_seq) int32
    query_start_loc: torch.Tensor,  # (num_seqs + 1,) int32
    seq_lens: torch.Tensor,  # (num_seqs,) int32
    scale: float,
    out: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,  # 8-bit caches only (kernels/torch_ref.py)
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    if out is None:
        out = torch.empty_like(query)
    pool = _Pool(key_cache, value_cache, k_scale, v_scale)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    q_lens = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    decodes = [s for s, n in enumerate(q_lens) if n == 1]
    if decodes:
        _decode(query, pool, block_tables, starts, lens, decodes, scale, out)
    for s, n in enumerate(q_lens):
        if n > 1:
            _prefill(query, pool, block_tables[s], starts[s], n, lens[s], scale, out)
    return out


def _prefill(query, pool: _Pool, table, q_start, q_len, seq_len, scale, out) -> None:
    _, block_size, kvh, d = pool.key.shape
    blocks = table[: (seq_len + block_size - 1) // block_size].long()
    q = query[q_start : q_start + q_len].transpose(0, 1).unsqueeze(0)  # (1, h, q, d)
    k, v = (  # (1, kvh, T, d)
        t.reshape(-1, kvh, d)[:seq_len].transpose(0, 1).unsqueeze(0)
        for t in pool.gather(blocks, q.dtype)
    )
    if seq_len == q_len:  # no cached context: plain causal
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:  # query i sits at position seq_len - q_len + i
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]  # (q, T)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    out[q_start : q_start + q_len] = o[0].transpose(0, 1)


def _decode(query, pool: _Pool, block_tables, starts, lens, seqs, scale, out) -> None:
    for part in _length_buckets(seqs, lens, pool.key.shape[2] * pool.key.shape[3]):
        _decode_bucket(query, pool, block_tables, starts, lens, part, scale, out)


def _length_buckets(seqs: list[int], lens: list[int], elems_per_token: int) -> list[list[int]]:
    """Decodes grouped by context length, so that padding each group to its longest member
    wastes at most ~30% of what it gathers, and each group stays under the gather budget."""
    order = sorted(seqs, key=lambda s: lens[s])
    buckets: list[list[int]] = []
    for s in order:
        cur = buckets[-1] if buckets else None
        if cur is not None:
            shortest, fits = lens[cur[0]], (len(cur) + 1) * lens[s] * elems_per_token
            if lens[s] <= 1.3 * shortest + 16 and fits <= _DECODE_GATHER_ELEMS:
                cur.append(s)
                continue
        buckets.append([s])
    return buckets


def _decode_bucket(query, pool: _Pool, block_tables, starts, lens, part, scale, out) -> None:
    _, block_size, kvh, d = pool.key.shape
    n, heads = len(part), query.shape[1]
    part_lens = torch.tensor([lens[s] for s in part], device=query.device)
    nb = (int(part_lens.max()) + block_size - 1) // block_size
    blocks = block_tables[part, :nb].reshape(-1).long()  # (S * nb,)
    length = nb * block_size
    valid = torch.arange(length, device=query.device)[None, :] < part_lens[:, None]  # (S, L)
    k, v = (t.view(n, length, kvh, d) for t in pool.gather(blocks, query.dtype))  # copies
    # Slots past a sequence's end hold whatever their last writer left; a masked score still
    # multiplies its value (0 x NaN is NaN), so clear them in the copy.
    k[~valid] = 0
    v[~valid] = 0
    rows = torch.tensor([starts[s] for s in part], device=query.device)
    q = query[rows].view(n, heads, 1, d)  # (S, h, 1, d)
    o = F.scaled_dot_product_attention(
        q,
        k.permute(0, 2, 1, 3),  # (S, kvh, L, d), read strided without a copy
        v.permute(0, 2, 1, 3),
        attn_mask=valid[:, None, None, :],
        scale=scale,
        enable_gqa=True,
    )  # (S, h, 1, d)
    out[rows] = o.view(n, heads, d).to(out.dtype)
