"""Plain-torch paged attention and KV writes: the reference every other backend must match,
and the CPU path.

Layout of one layer's paged pool (per device):
    key_cache, value_cache: (num_blocks, block_size, num_kv_heads, head_dim)
    k_scale, v_scale:       None for a float cache; for an 8-bit (int8 / float8_e4m3fn) cache,
                            (num_blocks, block_size, num_kv_heads) per token and head, or (1,)
                            per tensor (see kernels/kv_quant.py)
A token's slot is `block_id * block_size + offset`; slot -1 means "do not write" (padding).
"""

from __future__ import annotations

import torch

from kernels.kv_quant import dequantize, gather_scale, is_quantized, write_quantized


def write_kv_torch(
    key: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    value: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    key_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    value_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    slot_mapping: torch.Tensor,  # (num_tokens,) int, -1 to skip
    k_scale: torch.Tensor | None = None,  # 8-bit caches only: see the module docstring
    v_scale: torch.Tensor | None = None,
) -> None:
    """Scatter each token's K and V into its slot of the paged pool (quantized when the
    cache is 8-bit: per-token scales are computed and written, a per-tensor one is read)."""
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    slots = slot_mapping.long()
    if slots.numel() and int(slots.min()) < 0:  # some skipped (a profiling pass): rare
        valid = slots >= 0
        slots, key, value = slots[valid], key[valid], value[valid]
    if is_quantized(key_cache.dtype):
        write_quantized(key, key_cache, k_scale, slots)
        write_quantized(value, value_cache, v_scale, slots)
        return
    flat_k = key_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    flat_v = value_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    flat_k.index_copy_(0, slots, key if key.dtype == key_cache.dtype else key.to(key_cache.dtype))
    flat_v.index_copy_(0, slots, value if value.dtype == value_cache.dtype else value.to(value_cache.dtype))


def paged_attention_torch(
    query: torch.Tensor,  # (num_tokens, num_heads, head_dim)
    key_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    value_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    block_tables: torch.Tensor,  # (num_seqs, max_blocks_per_seq) int32, padded with any valid id
    query_start_loc: torch.Tensor,  # (num_seqs + 1,) int32: cumulative query lengths
    seq_lens: torch.Tensor,  # (num_seqs,) int32: context length incl. this step's tokens
    scale: float,
    out: torch.Tensor | None = None,  # (num_tokens, num_heads, head_dim)
    k_scale: torch.Tensor | None = None,  # 8-bit caches only: see the module docstring
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of a flat batch of query tokens over their sequences' paged K/V.

    Sequence s owns query rows query_start_loc[s]:query_start_loc[s+1]; they are its last
    q_len tokens, at positions seq_len - q_len .. seq_len - 1, and each attends to every
    cached position up to and including its own. Prefill chunks (q_len > 1, with or without
    cached context) and decodes (q_len == 1) mix freely. GQA: query head h reads KV head
    h // (num_heads // num_kv_heads). The K/V of this step must already be written. An
    8-bit cache is read as code x scale, in float32 like every other cache.
    """
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for s, seq_len in enumerate(lens):
        q_start, q_end = starts[s], starts[s + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        n_blocks = (seq_len + block_size - 1) // block_size
        blocks = block_tables[s, :n_blocks].long()
        k = _gather(key_cache, k_scale, blocks, seq_len)  # (T, kvh, d) float32
        v = _gather(value_cache, v_scale, blocks, seq_len)
        q = query[q_start:q_end].float().view(q_len, num_kv_heads, group, head_dim)
        scores = torch.einsum("qhgd,khd->hgqk", q, k) * scale  # (kvh, g, q, T)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        k_pos = torch.arange(seq_len, device=query.device)
        causal = k_pos[None, :] > q_pos[:, None]  # (q, T)
        scores.masked_fill_(causal, float("-inf"))
        probs = scores.softmax(dim=-1)
        o = torch.einsum("hgqk,khd->qhgd", probs, v)  # (q, kvh, g, d)
        out[q_start:q_end] = o.reshape(q_len, num_heads, head_dim).to(out.dtype)
    return out


def _gather(cache, scale, blocks, length) -> torch.Tensor:
    """(length, num_kv_heads, head_dim) float32 values of one sequence's blocks."""
    _, _, kvh, d = cache.shape
    part = cache[blocks]  # (n, block_size, kvh, d)
    if is_quantized(cache.dtype):
        part = dequantize(part, gather_scale(scale, blocks))
    return part.reshape(-1, kvh, d)[:length].float()
