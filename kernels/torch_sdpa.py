"""The CPU path: paged attention in plain torch built on fused kernels.

Same signature and semantics as `kernels.torch_ref.paged_attention_torch` (the reference it is
tested against), but fast enough to serve from: decodes (one query token per sequence) are
grouped by context length, gathered per group in the pool's layout and attended with two
batched matmuls (`_spread_heads` says how); a float32 prefill chunk runs through fused
`torch.nn.functional.scaled_dot_product_attention`, causal against its cached context, and a
16-bit one through tiled matmuls, which on CPU use the 16-bit units that fused SDPA leaves
idle. An 8-bit cache is dequantized (code x scale, kernels/kv_quant.py) into the query's dtype
as it is gathered, so the attention sees the same float K/V as with a 16-bit cache.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from kernels import cpu_decode
from kernels.kv_quant import dequantize, gather_scale

# Padded K/V of a decode batch is gathered in groups of at most this many elements, so that a
# batch of long contexts does not double the memory of the pool it reads.
_DECODE_GATHER_ELEMS = 1 << 24
# Decodes of a step up to this many attend one sequence at a time (`_decode_one`: a dozen ops
# each, no padding, no masks); more go through the length buckets, whose ~35 ops a bucket are
# shared by every sequence in it. At 2 decodes the two ran even on CPU (benchmarks/RESULTS.md).
_PER_SEQUENCE_DECODES = 2
# Queries per tile of a 16-bit prefill: larger tiles make fewer and larger matmuls, smaller
# ones compute less of the masked triangle; 128 ran fastest of 32-256 on CPU
# (benchmarks/RESULTS.md). A tile's scores (kvh x g x tile x keys) stay in the last-level cache.
_PREFILL_TILE = 128


class Workspace:
    """Grow-only scratch for the gathered K/V copies, reused by every layer and step of one
    model (they run one after another). A fresh tensor of megabytes per gather costs page
    faults that on CPU take longer than the copy itself (benchmarks/RESULTS.md)."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def spread(self, q: torch.Tensor, kvh: int, scale: float) -> torch.Tensor:
        """`_spread_heads` of one decode's (h, d) query, (h, kvh * d), in a kept buffer whose
        off-diagonal blocks stay zero: only the diagonal is written, one op instead of a
        block_diag. Valid until the next call."""
        heads, d = q.shape
        key = f"spread-{heads}-{kvh}-{d}"
        buf = self._buffers.get(key)
        if buf is None or buf.dtype != q.dtype or buf.device != q.device:
            buf = self._buffers[key] = q.new_zeros(heads, kvh * d)
        g = heads // kvh
        diagonal = buf.view(kvh, g, kvh, d).diagonal(dim1=0, dim2=2)  # (g, d, kvh): head i's own KV head
        torch.mul(q.view(kvh, g, d).permute(1, 2, 0), scale, out=diagonal)
        return buf

    def floats(self, name: str, n: int) -> torch.Tensor:
        """A float32 CPU scratch buffer of at least `n` elements (its whole, grown as needed:
        no view made per call), valid until the next call for `name`."""
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < n:
            buf = self._buffers[name] = torch.empty(n, dtype=torch.float32)
        return buf

    def take(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """A scratch tensor of `shape` with `like`'s dtype and device; its contents are
        whatever the last user left, and it is valid until the next `take` of `name`."""
        n = math.prod(shape)
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < n or buf.dtype != like.dtype or buf.device != like.device:
            buf = self._buffers[name] = torch.empty(n, dtype=like.dtype, device=like.device)
        return buf[:n].view(shape)


class _Pool(NamedTuple):
    """One layer's K/V caches and, for an 8-bit cache, their scales."""

    key: torch.Tensor  # (num_blocks, block_size, num_kv_heads, head_dim)
    value: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    workspace: Workspace | None

    def gather(self, blocks: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """K and V of `blocks` (n,), (n, block_size, kvh, d) copies in `dtype` (in the
        workspace, when there is one and the cache is of `dtype`)."""
        if self.k_scale is None and self.key.dtype == dtype and self.workspace is not None:
            shape = (blocks.numel(), *self.key.shape[1:])
            return tuple(
                torch.index_select(cache, 0, blocks, out=self.workspace.take(name, shape, cache))
                for name, cache in (("k", self.key), ("v", self.value))
            )
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
    workspace: Workspace | None = None,  # scratch for gathered K/V; None: fresh tensors
) -> torch.Tensor:
    pool = _Pool(key_cache, value_cache, k_scale, v_scale, workspace)
    lens = seq_lens.tolist()
    if workspace is not None and cpu_decode.supports(query, key_cache, value_cache, k_scale is not None):
        return _with_kernel(query, pool, block_tables, query_start_loc, lens, scale, out)
    if out is None and len(lens) == 1 and query.shape[0] == 1:  # one decode: its output is the result
        return _decode_one(query[0], pool, block_tables[0], lens[0], scale).unsqueeze(0)
    if out is None:
        out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    q_lens = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    decodes = [s for s, n in enumerate(q_lens) if n == 1]
    if len(decodes) > _PER_SEQUENCE_DECODES:
        _decode(query, pool, block_tables, starts, lens, decodes, scale, out)
    for s in decodes if len(decodes) <= _PER_SEQUENCE_DECODES else ():
        out[starts[s]] = _decode_one(query[starts[s]], pool, block_tables[s], lens[s], scale)
    for s, n in enumerate(q_lens):
        if n > 1:
            _prefill(query, pool, block_tables[s], starts[s], n, lens[s], scale, out)
    return out


def _with_kernel(query, pool: _Pool, block_tables, query_start_loc, lens, scale, out) -> torch.Tensor:
    """The step's attention through the CPU kernel (kernels/cpu_decode.py): every decode in one
    call, whether alone in its step or in a batch; and in 16 bits every prefill row too, each
    as a decode of the positions it sees. A token's K/V then never depends on how it was
    computed (the one arithmetic for all rows), so a stream resumed, moved or recomputed after
    a pull continues with the tokens of the undisturbed one. A float32 prefill keeps fused
    SDPA, several times faster there and as close to the kernel as float32 rounds."""
    if out is None:
        out = torch.empty_like(query)
    heads, d, threads = query.shape[1], query.shape[2], torch.get_num_threads()
    # (one scratch for every call below: no row sees more than the longest sequence)
    scratch = pool.workspace.floats("decode-scratch", cpu_decode.scratch_size(heads, max(lens), d, threads))
    if query.shape[0] == len(lens):  # a step of decodes only: row s is sequence s's
        cpu_decode.decode(query, pool.key, pool.value, block_tables, range(len(lens)), lens, scale, out, scratch)
        return out
    starts = query_start_loc.tolist()
    q_lens = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    decodes = [s for s, n in enumerate(q_lens) if n == 1]
    rows_of_all = query.dtype != torch.float32  # (prefill rows through the kernel too)
    if decodes:
        rows, decode_lens = [starts[s] for s in decodes], [lens[s] for s in decodes]
        cpu_decode.decode(query, pool.key, pool.value, block_tables[decodes], rows, decode_lens, scale, out, scratch)
    for s, n in enumerate(q_lens):
        if n <= 1:
            continue
        if not rows_of_all:
            _prefill(query, pool, block_tables[s], starts[s], n, lens[s], scale, out)
            continue
        seen = range(lens[s] - n + 1, lens[s] + 1)  # (row i sees the context and the rows up to itself)
        table = block_tables[s : s + 1].expand(n, -1)  # (one table for every row: stride 0)
        cpu_decode.decode(
            query, pool.key, pool.value, table, range(starts[s], starts[s] + n), seen, scale, out, scratch
        )
    return out


def _prefill(query, pool: _Pool, table, q_start, q_len, seq_len, scale, out) -> None:
    _, block_size, kvh, d = pool.key.shape
    blocks = table[: (seq_len + block_size - 1) // block_size].long()
    k, v = (t.reshape(-1, kvh, d)[:seq_len] for t in pool.gather(blocks, query.dtype))  # (T, kvh, d)
    q = query[q_start : q_start + q_len]  # (q, h, d)
    if query.dtype == torch.float32:
        out[q_start : q_start + q_len] = _prefill_sdpa(q, k, v, scale)
    else:
        _prefill_tiled(q, k, v, scale, pool.workspace, out[q_start : q_start + q_len])


def _prefill_sdpa(q, k, v, scale: float) -> torch.Tensor:
    """(q, h, d) queries, the last q of T positions, over (T, kvh, d) K/V: fused SDPA."""
    q_len, seq_len = q.shape[0], k.shape[0]
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # (1, heads, len, d)
    if seq_len == q_len:  # no cached context: plain causal
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:  # query i sits at position seq_len - q_len + i
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]  # (q, T)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


def _prefill_tiled(
    q, k, v, scale: float, workspace: Workspace | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Same as `_prefill_sdpa`, for 16-bit dtypes: tiles of _PREFILL_TILE queries, each a
    batched matmul per KV head over the keys it can see, a softmax (float inside) and a
    matmul with V. On CPU, fused SDPA runs 16-bit attention no faster than float32, while
    16-bit matmuls run at several times the float32 rate (benchmarks/RESULTS.md).

    A KV head's rows are its queries' heads in (query, head) order, so that a tile's rows are
    one slice of the scaled queries, copied once; scores, softmax (in place) and outputs
    reuse the workspace's buffers: fresh megabytes per tile cost page faults on CPU."""
    ws = workspace or Workspace()
    q_len, heads, d = q.shape
    seq_len, kvh, _ = k.shape
    group, context, tile = heads // kvh, seq_len - q_len, _PREFILL_TILE
    kt = ws.take("kt", (kvh, d, seq_len), k)
    kt.copy_(k.permute(1, 2, 0))  # (kvh, d, T)
    vt = ws.take("vt", (kvh, seq_len, d), v)
    vt.copy_(v.transpose(0, 1))  # (kvh, T, d)
    qs = ws.take("q", (kvh, q_len, group, d), q)  # (kvh, q, g, d), times the scale
    torch.mul(q.view(q_len, kvh, group, d).transpose(0, 1), scale, out=qs)
    future = torch.full((tile, tile), float("-inf"), dtype=q.dtype, device=q.device).triu_(1)
    future = future[:, None]  # (tile, 1, tile): query i masks the tile's keys after it
    out = torch.empty_like(q) if out is None else out
    for a in range(0, q_len, tile):
        n = min(tile, q_len - a)
        keys = context + a + n  # the tile's last query sees these
        scores = ws.take("scores", (kvh, n * group, keys), q)
        torch.bmm(qs[:, a : a + n].view(kvh, n * group, d), kt[:, :, :keys], out=scores)
        scores.view(kvh, n, group, keys)[..., context + a :] += future[:n, :, :n]
        torch.softmax(scores, dim=-1, out=scores)
        o = ws.take("o", (kvh, n * group, d), q)
        torch.bmm(scores, vt[:, :keys], out=o)
        out[a : a + n].view(n, kvh, group, d).copy_(o.view(kvh, n, group, d).transpose(0, 1))
    return out


def _decode_one(q, pool: _Pool, table, seq_len: int, scale: float) -> torch.Tensor:
    """One query token (h, d) over its sequence's first `seq_len` cached positions: (h, d).

    The blocks are gathered in the pool's layout and cut at the sequence's end, so no slot
    past it is read and nothing needs a mask. The scores are one matmul of the query heads,
    spread block-diagonally over their KV heads' columns (`_spread_heads`, here the
    workspace's kept buffer), against the gathered (L, kvh * d) keys, which BLAS reads
    transposed in place; the values one batched matmul per KV head over its group's
    probabilities. Same roundings as the bucketed path: the scaled query and the scores in
    the query's dtype, the softmax in float32, the probabilities back in the query's dtype."""
    _, block_size, kvh, d = pool.key.shape
    heads = q.shape[0]
    g = heads // kvh
    k, v = (t.view(-1, kvh * d)[:seq_len] for t in pool.gather(table[: -(-seq_len // block_size)], q.dtype))
    if pool.workspace is not None:
        spread = pool.workspace.spread(q, kvh, scale)  # (h, kvh * d)
    else:
        spread = torch.block_diag(*(q.view(kvh, g, d) * scale).unbind(0))
    probs = torch.softmax(torch.mm(spread, k.t()), dim=-1, dtype=torch.float32).to(q.dtype)  # (h, L)
    o = torch.bmm(probs.view(kvh, g, seq_len), v.view(seq_len, kvh, d).transpose(0, 1))  # (kvh, g, d)
    return o.view(heads, d)


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
    nb = (max(lens[s] for s in part) + block_size - 1) // block_size
    blocks = block_tables[part, :nb].reshape(-1).long()  # (S * nb,)
    length = nb * block_size
    # (S, L, kvh * d) copies, each token's KV heads side by side as the pool stores them.
    k, v = (t.view(n, length, kvh * d) for t in pool.gather(blocks, query.dtype))
    ends = [lens[s] for s in part]
    # Slots past a sequence's end hold whatever their last writer left; a masked score still
    # multiplies its value (0 x NaN is NaN), so clear them in the copy. K needs no clearing:
    # its scores there are replaced by -inf. (A slice fill per sequence: a broadcast
    # masked_fill_ over the copy costs as much as the attention.)
    for i, end in enumerate(ends):
        v[i, end:] = 0
    rows = torch.tensor([starts[s] for s in part], device=query.device)
    q = _spread_heads(query[rows], kvh, scale)  # (S, h, kvh * d)
    scores = torch.matmul(q, k.transpose(1, 2)).float()  # (S, h, L)
    for i, end in enumerate(ends):
        scores[i, :, end:] = float("-inf")
    probs = scores.softmax(dim=-1).to(v.dtype)
    o = torch.matmul(probs, v).view(n, heads, kvh, d)  # (S, h, kvh, d): every KV head's mix
    own = torch.arange(heads, device=query.device)
    out[rows] = o[:, own, own // (heads // kvh)].to(out.dtype)  # (S, h, d): its own KV head's


def _spread_heads(q: torch.Tensor, kvh: int, scale: float) -> torch.Tensor:
    """(S, h, d) queries -> (S, h, kvh * d), query head i (times `scale`) in the columns of its
    KV head i // (h / kvh) and zeros elsewhere.

    A decode reads each sequence's K/V once from a gathered copy of shape (S, L, kvh * d), the
    pool's own layout; against these spread queries, scores and outputs are two plain batched
    matmuls over it, with no transposed copy of K/V per KV head. The zero columns cost kvh
    times the (small) FLOPs of a memory-bound step. Fused SDPA over a padding mask was no
    faster in float32 and several times slower in bfloat16 on CPU (benchmarks/RESULTS.md).
    """
    n, heads, d = q.shape
    spread = q.new_zeros(n, heads, kvh, d)
    own = torch.arange(heads, device=q.device)
    spread[:, own, own // (heads // kvh)] = q * scale
    return spread.view(n, heads, kvh * d)
