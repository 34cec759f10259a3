"""The CPU path: paged attention in plain torch built on fused kernels.

Same signature and semantics as `kernels.torch_ref.paged_attention_torch` (the reference it is
tested against), but fast enough to serve from: decodes (one query token per sequence) are
grouped by context length, gathered per group and attended in one fused
`torch.nn.functional.scaled_dot_product_attention` call with a padding mask; prefill chunks run
through the same fused call per sequence, causal against their cached context.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Padded K/V of a decode batch is gathered in groups of at most this many elements, so that a
# batch of long contexts does not double the memory of the pool it reads.
_DECODE_GATHER_ELEMS = 1 << 24


def paged_attention_sdpa(
    query: torch.Tensor,  # (num_tokens, num_heads, head_dim)
    key_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    value_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    block_tables: torch.Tensor,  # (num_seqs, max_blocks_per_seq) int32
    query_start_loc: torch.Tensor,  # (num_seqs + 1,) int32
    seq_lens: torch.Tensor,  # (num_seqs,) int32
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    if out is None:
        out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    q_lens = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    decodes = [s for s, n in enumerate(q_lens) if n == 1]
    if decodes:
        _decode(query, key_cache, value_cache, block_tables, starts, lens, decodes, scale, out)
    for s, n in enumerate(q_lens):
        if n > 1:
            _prefill(
                query, key_cache, value_cache, block_tables[s], starts[s], n, lens[s], scale, out
            )
    return out


def _gather(cache: torch.Tensor, blocks: torch.Tensor, length: int) -> torch.Tensor:
    """(num_kv_heads, length, head_dim) of one sequence's cache."""
    _, block_size, kvh, d = cache.shape
    return cache[blocks].reshape(-1, kvh, d)[:length].transpose(0, 1)


def _prefill(query, key_cache, value_cache, table, q_start, q_len, seq_len, scale, out) -> None:
    block_size = key_cache.shape[1]
    blocks = table[: (seq_len + block_size - 1) // block_size].long()
    k = _gather(key_cache, blocks, seq_len).unsqueeze(0)  # (1, kvh, T, d)
    v = _gather(value_cache, blocks, seq_len).unsqueeze(0)
    q = query[q_start : q_start + q_len].transpose(0, 1).unsqueeze(0)  # (1, h, q, d)
    k, v = k.to(q.dtype), v.to(q.dtype)
    if seq_len == q_len:  # no cached context: plain causal
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:  # query i sits at position seq_len - q_len + i
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]  # (q, T)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    out[q_start : q_start + q_len] = o[0].transpose(0, 1)


def _decode(query, key_cache, value_cache, block_tables, starts, lens, seqs, scale, out) -> None:
    for part in _length_buckets(seqs, lens, key_cache.shape[2] * key_cache.shape[3]):
        _decode_bucket(query, key_cache, value_cache, block_tables, starts, lens, part, scale, out)


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


def _decode_bucket(
    query, key_cache, value_cache, block_tables, starts, lens, part, scale, out
) -> None:
    _, block_size, kvh, d = key_cache.shape
    n, heads = len(part), query.shape[1]
    part_lens = torch.tensor([lens[s] for s in part], device=query.device)
    nb = (int(part_lens.max()) + block_size - 1) // block_size
    blocks = block_tables[part, :nb].reshape(-1).long()  # (S * nb,)
    length = nb * block_size
    valid = torch.arange(length, device=query.device)[None, :] < part_lens[:, None]  # (S, L)
    k = key_cache.index_select(0, blocks).view(n, length, kvh, d)  # a gathered copy
    v = value_cache.index_select(0, blocks).view(n, length, kvh, d)
    # Slots past a sequence's end hold whatever their last writer left; a masked score still
    # multiplies its value (0 x NaN is NaN), so clear them in the copy.
    k[~valid] = 0
    v[~valid] = 0
    rows = torch.tensor([starts[s] for s in part], device=query.device)
    q = query[rows].view(n, heads, 1, d)  # (S, h, 1, d)
    o = F.scaled_dot_product_attention(
        q,
        k.permute(0, 2, 1, 3).to(q.dtype),  # (S, kvh, L, d), read strided without a copy
        v.permute(0, 2, 1, 3).to(q.dtype),
        attn_mask=valid[:, None, None, :],
        scale=scale,
        enable_gqa=True,
    )  # (S, h, 1, d)
    out[rows] = o.view(n, heads, d).to(out.dtype)
