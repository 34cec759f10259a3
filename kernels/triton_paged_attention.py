"""Paged attention over a flat variable-length batch, as Triton kernels.

One program owns one tile of query rows of one sequence and one KV head. A tile packs
BLOCK_Q query tokens x GROUP_PAD query heads (all heads that share the KV head) into the M
dimension, so decodes under GQA/MQA still feed `tl.dot` a matrix of at least 16 rows, and
each K/V tile is read once for the whole group.

Two paths share one kernel body:
- direct: one program walks all context a tile may see and writes the output;
- split-KV (flash-decoding): `num_splits` programs per tile each walk one range of the
  context and write a partial output plus its log-sum-exp; `_merge_splits_kernel` merges
  them. Chosen by `choose_num_splits` (see there) when the batch is all decodes and too
  few (sequence, KV head) pairs exist to fill the GPU.

Layout and argument meaning: see kernels/torch_ref.py (`paged_attention_torch` is the
reference this file must match).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from kernels.kv_quant import check_scales, is_quantized
from kernels.triton_write_kv import scale_strides, scales_mode

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INT_DTYPES = (torch.int32, torch.int64)
_MAX_SPLITS = 32
_LOG2E = 1.4426950408889634


@triton.jit
def _find_seq(query_start_loc, tile, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence owning query tile `tile`: sequence s owns tiles from
    query_start_loc[s] // BLOCK_Q + s on, enough for its query rows (binary search)."""
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc + mid) // BLOCK_Q + mid <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _token_scales(scale, block, pos, pos_ok, kv_head, stride_b, stride_s, PAGE: tl.constexpr):
    """(BLOCK_N,) float32 per-token scales of this KV head at positions `pos`."""
    ptrs = scale + block * stride_b + (pos % PAGE) * stride_s + kv_head
    return tl.load(ptrs, mask=pos_ok, other=0.0).to(tl.float32)


@triton.jit
def _paged_attention_kernel(
    query,
    key_cache,
    value_cache,
    block_tables,
    query_start_loc,
    seq_lens,
    out,
    partial_out,
    partial_lse,
    k_scale,
    v_scale,
    scale_log2,
    num_seqs,
    num_splits,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_ot,
    stride_oh,
    stride_ps,
    stride_pt,
    stride_ph,
    stride_ls,
    stride_lt,
    stride_ksb,
    stride_kss,
    stride_vsb,
    stride_vss,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    PAGE: tl.constexpr,
    SPLIT: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    SCALES: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = _find_seq(query_start_loc, tile, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc + seq)
    q_len = tl.load(query_start_loc + seq + 1) - q_start
    local = tile - (q_start // BLOCK_Q + seq)  # this tile's index within its sequence
    if local * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens + seq)
    ctx_len = seq_len - q_len  # positions cached before this step's queries

    # Row m of the tile is query token m // GROUP_PAD, head m % GROUP_PAD of this KV head.
    rows = tl.arange(0, BLOCK_M)
    q_tok = local * BLOCK_Q + rows // GROUP_PAD  # (BLOCK_M,) index within the sequence
    head = kv_head * GROUP + rows % GROUP_PAD  # (BLOCK_M,)
    row_ok = (q_tok < q_len) & (rows % GROUP_PAD < GROUP)
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < HEAD_DIM
    q_ptrs = query + (q_start + q_tok)[:, None] * stride_qt + head[:, None] * stride_qh
    q = tl.load(q_ptrs + dims[None, :], mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    q_pos = ctx_len + q_tok  # (BLOCK_M,) absolute position, for the causal mask

    # Keys this tile may see: [lo, hi); the last query row of the tile bounds it.
    hi = tl.minimum(ctx_len + (local + 1) * BLOCK_Q, seq_len)
    lo = 0
    if SPLIT:
        chunk = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
        lo = split * chunk
        hi = tl.minimum(hi, lo + chunk)

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # running max (log2 units); finite so
    l_i = tl.zeros([BLOCK_M], tl.float32)  # fully masked rows give exp2(-inf) = 0, not NaN
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    if UPCAST:
        q = q.to(tl.float32)
    # 8-bit caches: codes become the query's dtype exactly (int8 and e4m3 fit in 16-bit
    # floats); their scales multiply the scores (K) and the probabilities (V) in float32.
    # A per-tensor scale is folded into the score scale and, for V, into the output.
    qk_scale = scale_log2
    if SCALES == 2:
        qk_scale = scale_log2 * tl.load(k_scale).to(tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
        pos_ok = pos < hi
        block = tl.load(block_tables + seq * stride_bt + pos // PAGE, mask=pos_ok, other=0)
        block = block.to(tl.int64)  # pools larger than 2**31 elements
        k_off = block * stride_kb + (pos % PAGE) * stride_ks + kv_head * stride_kh
        kv_mask = pos_ok[None, :] & dim_ok[:, None]
        k = tl.load(key_cache + k_off[None, :] + dims[:, None], mask=kv_mask, other=0.0)
        if SCALES != 0:
            k = k.to(q.dtype)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, k, input_precision=PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N)
        if SCALES == 1:
            ks = _token_scales(k_scale, block, pos, pos_ok, kv_head, stride_ksb, stride_kss, PAGE)
            s = s * ks[None, :]
        visible = (pos[None, :] <= q_pos[:, None]) & pos_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_off = block * stride_vb + (pos % PAGE) * stride_vs + kv_head * stride_vh
        v_mask = pos_ok[:, None] & dim_ok[None, :]
        v = tl.load(value_cache + v_off[:, None] + dims[None, :], mask=v_mask, other=0.0)
        if SCALES != 0:
            v = v.to(q.dtype)
        if SCALES == 1:
            vs = _token_scales(v_scale, block, pos, pos_ok, kv_head, stride_vsb, stride_vss, PAGE)
            p = p * vs[None, :]
        p = p.to(v.dtype)
        if UPCAST:
            p = p.to(tl.float32)
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    if SCALES == 2:
        o = o * tl.load(v_scale).to(tl.float32)
    store_mask = row_ok[:, None] & dim_ok[None, :]
    tok = q_start + q_tok
    if SPLIT:
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))  # log2 units
        p_ptrs = partial_out + split * stride_ps + tok[:, None] * stride_pt
        tl.store(p_ptrs + head[:, None] * stride_ph + dims[None, :], o, mask=store_mask)
        lse_ptrs = partial_lse + split * stride_ls + tok * stride_lt + head
        tl.store(lse_ptrs, lse, mask=row_ok)
    else:
        o_ptrs = out + tok[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
        tl.store(o_ptrs, o.to(out.dtype.element_ty), mask=store_mask)


@triton.jit
def _merge_splits_kernel(
    partial_out,
    partial_lse,
    out,
    num_splits,
    stride_ps,
    stride_pt,
    stride_ph,
    stride_ls,
    stride_lt,
    stride_ot,
    stride_oh,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
):
    """out[t, h] = sum_s w_s * partial_out[s, t, h], w = softmax over s of partial_lse."""
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_PAD)
    split_ok = splits < num_splits
    lse_ptrs = partial_lse + splits * stride_ls + tok * stride_lt + head
    lse = tl.load(lse_ptrs, mask=split_ok, other=float("-inf"))  # (SPLITS_PAD,)
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # a row no split saw: weights all 0
    w = tl.exp2(lse - m)
    total = tl.sum(w, 0)
    w = w / tl.where(total == 0.0, 1.0, total)
    p_ptrs = partial_out + splits[:, None] * stride_ps + tok * stride_pt + head * stride_ph
    mask = split_ok[:, None] & (dims[None, :] < HEAD_DIM)
    parts = tl.load(p_ptrs + dims[None, :], mask=mask, other=0.0)  # (SPLITS_PAD, HEAD_PAD)
    o = tl.sum(parts * w[:, None], 0)
    tl.store(
        out + tok * stride_ot + head * stride_oh + dims,
        o.to(out.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


def choose_num_splits(num_tokens: int, num_seqs: int, num_kv_heads: int, device: torch.device) -> int:
    """How many context ranges each (sequence, KV head) is split into; 1 = direct path.

    Rule: split only on CUDA, only when the batch is all decodes (num_tokens == num_seqs)
    and the direct path would launch fewer programs (num_seqs x num_kv_heads) than the GPU
    has SMs; then aim at about 4 programs per SM, at most 32 splits. The rule needs no
    context length (no host sync): each sequence's split size is ceil(seq_len / num_splits)
    rounded up to whole KV tiles, so splits past a short sequence's end exit at once.
    """
    if device.type != "cuda" or num_tokens != num_seqs:
        return 1
    programs = num_seqs * num_kv_heads
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if programs >= sms:
        return 1
    return max(1, min(_MAX_SPLITS, math.ceil(4 * sms / programs)))


def _check_float(name: str, t: torch.Tensor, like: torch.Tensor) -> None:
    """A float tensor in `like`'s dtype, or (caches) an 8-bit one."""
    if not (name.endswith("_cache") and is_quantized(t.dtype)):
        if t.dtype not in _DTYPES:
            raise ValueError(f"{name} dtype {t.dtype} is not one of {_DTYPES} (or int8/float8)")
        if t.dtype != like.dtype:
            raise ValueError(f"{name} dtype {t.dtype} != query dtype {like.dtype}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in head_dim (stride {t.stride(-1)})")
    if t.device != like.device:
        raise ValueError(f"{name} is on {t.device} but query is on {like.device}")


def _check_index(name: str, t: torch.Tensor, shape: tuple, like: torch.Tensor) -> None:
    """`shape` may end in None: any size there."""
    ok = t.dim() == len(shape) and all(s is None or s == n for s, n in zip(shape, t.shape, strict=True))
    if not ok or t.dtype not in _INT_DTYPES:
        raise ValueError(f"{name} must be int32/int64 of shape {shape}, got {t.dtype} {tuple(t.shape)}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension")
    if t.device != like.device:
        raise ValueError(f"{name} is on {t.device} but query is on {like.device}")


def _check_inputs(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, out, k_scale, v_scale):
    """Raise ValueError naming the first argument that breaks the contract."""
    if query.dim() != 3:
        raise ValueError(f"query must be (num_tokens, num_heads, head_dim), got {query.shape}")
    if key_cache.dim() != 4:
        raise ValueError(
            f"key_cache must be (num_blocks, block_size, num_kv_heads, head_dim), got {tuple(key_cache.shape)}"
        )
    if key_cache.shape[3] != query.shape[2]:
        raise ValueError(f"query head_dim {query.shape[2]} != key_cache {key_cache.shape[3]}")
    if value_cache.shape != key_cache.shape:
        raise ValueError(f"value_cache shape {value_cache.shape} != key_cache {key_cache.shape}")
    if query.shape[1] % key_cache.shape[2]:
        raise ValueError(f"query heads {query.shape[1]} % num_kv_heads {key_cache.shape[2]} != 0")
    if query.shape[2] > 256:
        raise ValueError(f"query head_dim {query.shape[2]} > 256 is not supported")
    for name, t in (("query", query), ("key_cache", key_cache), ("value_cache", value_cache)):
        _check_float(name, t, query)
    if value_cache.dtype != key_cache.dtype:
        raise ValueError(f"value_cache dtype {value_cache.dtype} != key_cache {key_cache.dtype}")
    check_scales(key_cache, k_scale, v_scale)
    if out is not None:
        if out.shape != query.shape:
            raise ValueError(f"out shape {tuple(out.shape)} != query shape {tuple(query.shape)}")
        _check_float("out", out, query)
    num_seqs = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    _check_index("seq_lens", seq_lens, (num_seqs,), query)
    _check_index("query_start_loc", query_start_loc, (num_seqs + 1,), query)
    _check_index("block_tables", block_tables, (num_seqs, None), query)
    if query.device.type != "cuda" and not isinstance(_paged_attention_kernel, InterpretedFunction):
        raise ValueError(f"query is on {query.device}: Triton needs CUDA or TRITON_INTERPRET=1")


def _tile_shape(num_tokens: int, num_seqs: int, group: int) -> tuple[int, int, int]:
    """(GROUP_PAD, BLOCK_Q, BLOCK_M): a decode-only batch has one query token per
    sequence, so a 16-row tile (one MMA's rows) wastes least; prefill wants 64 rows."""
    group_pad = triton.next_power_of_2(group)
    block_m = max(16 if num_tokens == num_seqs else 64, group_pad)
    return group_pad, block_m // group_pad, block_m


def _block_n(head_pad: int, dtype: torch.dtype) -> int:
    """Keys per inner-loop step: 64, halved for wide heads and float32 so the K/V tiles of
    the software pipeline stay well inside shared memory (~75 KB at head_dim 128 fp32)."""
    return 32 if head_pad > 128 or dtype == torch.float32 else 64


def paged_attention_triton(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Causal attention of a flat batch of query tokens over their sequences' paged K/V.

    Same contract as `kernels.torch_ref.paged_attention_torch`:
        query:           (num_tokens, num_heads, head_dim) float16/bfloat16/float32
        key_cache:       (num_blocks, block_size, num_kv_heads, head_dim), query's dtype,
                         or int8 / float8_e4m3fn codes (kernels/kv_quant.py)
        value_cache:     (num_blocks, block_size, num_kv_heads, head_dim), key_cache's dtype
        block_tables:    (num_seqs, max_blocks_per_seq) int32
        query_start_loc: (num_seqs + 1,) int32, cumulative query lengths
        seq_lens:        (num_seqs,) int32, context length including this step's tokens
        out:             (num_tokens, num_heads, head_dim) or None
        k_scale/v_scale: 8-bit caches only: (num_blocks, block_size, num_kv_heads) per
                         token and head, or (1,) per tensor; dequantized in the inner loop
        num_splits:      context ranges per (sequence, KV head); None lets
                         `choose_num_splits` decide, 1 forces the direct path.
    Returns out. Head dims that are not a power of two are padded and masked.
    """
    _check_inputs(
        query,
        key_cache,
        value_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        out,
        k_scale,
        v_scale,
    )
    num_tokens, num_heads, head_dim = query.shape
    _, page, num_kv_heads, _ = key_cache.shape
    num_seqs = seq_lens.shape[0]
    if out is None:
        out = torch.empty_like(query)
    if num_tokens == 0 or num_seqs == 0:
        return out
    if num_splits is None:
        num_splits = choose_num_splits(num_tokens, num_seqs, num_kv_heads, query.device)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    group = num_heads // num_kv_heads
    group_pad, block_q, block_m = _tile_shape(num_tokens, num_seqs, group)
    head_pad = max(16, triton.next_power_of_2(head_dim))
    split = num_splits > 1
    # Split path: per-split outputs and log-sum-exps; the direct path ignores these.
    f32 = dict(device=query.device, dtype=torch.float32)
    shape = (num_splits, num_tokens, num_heads) if split else (1, 1, 1)
    partial = torch.empty(*shape, head_dim, **f32)  # (splits, tokens, heads, head_dim)
    lse = torch.empty(*shape, **f32)  # (splits, tokens, heads), log2 units
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_splits)
    _paged_attention_kernel[grid](
        query,
        key_cache,
        value_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        out,
        partial,
        lse,
        key_cache if k_scale is None else k_scale,
        value_cache if v_scale is None else v_scale,
        scale * _LOG2E,
        num_seqs,
        num_splits,
        query.stride(0),
        query.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        partial.stride(0),
        partial.stride(1),
        partial.stride(2),
        lse.stride(0),
        lse.stride(1),
        *scale_strides(k_scale),
        *scale_strides(v_scale),
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_N=_block_n(head_pad, query.dtype),
        HEAD_DIM=head_dim,
        HEAD_PAD=head_pad,
        PAGE=page,
        SPLIT=split,
        # The interpreter multiplies bfloat16 bit patterns as integers in tl.dot; exact
        # float32 operands there. Compiled kernels use the bf16 tensor cores.
        UPCAST=query.dtype == torch.bfloat16 and query.device.type != "cuda",
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        SCALES=scales_mode(k_scale),
        num_warps=4,
        num_stages=2,
    )
    if split:
        _merge_splits_kernel[(num_tokens, num_heads)](
            partial,
            lse,
            out,
            num_splits,
            partial.stride(0),
            partial.stride(1),
            partial.stride(2),
            lse.stride(0),
            lse.stride(1),
            out.stride(0),
            out.stride(1),
            SPLITS_PAD=triton.next_power_of_2(num_splits),
            HEAD_DIM=head_dim,
            HEAD_PAD=head_pad,
        )
    return out
