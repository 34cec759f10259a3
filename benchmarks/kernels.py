"""Kernel speed: Triton paged attention against the torch reference and torch SDPA on the
same inputs. One JSON line per case.

Decode (one query token per sequence) at each context x batch: achieved bytes/s over the
KV cache it must read and the fraction of peak HBM bandwidth. Prefill chunks (with and
without cached context): achieved TFLOP/s. Ratios are from the same run.

With `--kv-cache-dtype auto,int8,fp8_e4m3` every case runs once per KV cache: the 16-bit one
(`--dtype`) and 8-bit ones (codes and scales, kernels/kv_quant.py) written from the same K/V;
an 8-bit line's bytes count its codes and scales, `speedup_vs_16bit` is its Triton time against
the 16-bit cache's on the same case, and `max_abs_err_vs_sdpa` is against SDPA over the K/V
the 8-bit cache gives back.

    python benchmarks/kernels.py                 # on CUDA: the full grid
    python benchmarks/kernels.py --smoke         # tiny shapes; on CPU via the Triton interpreter
    python benchmarks/kernels.py --kv-cache-dtype auto,int8,fp8_e4m3   # 8-bit decode bandwidth

Without CUDA the script always runs the smoke configuration under TRITON_INTERPRET=1 and its
numbers say nothing about kernel speed; they only prove the script runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch.nn.functional as F  # noqa: E402

from kernels.kv_quant import FP8_E4M3, dequantize, gather_scale  # noqa: E402
from kernels.torch_ref import paged_attention_torch, write_kv_torch  # noqa: E402
from kernels.triton_attention import choose_num_splits, paged_attention_triton  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
KV_8BIT = {"int8": torch.int8, "fp8_e4m3": FP8_E4M3}  # int8: per-token scales; fp8: per tensor


def sig4(x: float) -> float:
    """x to 4 significant digits, for readable JSON."""
    return float(f"{x:.4g}")


def time_ms(fn: Callable[[], object], device: str, flush: torch.Tensor | None) -> float:
    """Median milliseconds per call. On CUDA: CUDA events around each call after warm-up,
    with the L2 cache flushed before each call so small KV caches are read from HBM."""
    if device != "cuda":
        fn()
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    iters = max(3, min(50, int(0.3 / max(time.perf_counter() - t, 1e-6))))
    times = []
    for _ in range(iters):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def make_paged(args, q_lens: list[int], seq_lens: list[int], device: str):
    """A pool holding exactly these sequences in shuffled blocks, plus their queries.
    Returns the argument tuple of `paged_attention_triton` (scale last)."""
    page, kvh, d, dtype = args.page, args.kv_heads, args.head_dim, DTYPES[args.dtype]
    nblk = [math.ceil(n / page) for n in seq_lens]
    perm = torch.randperm(sum(nblk), device=device, dtype=torch.int32)
    table = torch.zeros(len(seq_lens), max(nblk), dtype=torch.int32, device=device)
    used = 0
    for s, n in enumerate(nblk):
        table[s, :n] = perm[used : used + n]
        used += n
    key_cache = torch.randn(sum(nblk), page, kvh, d, device=device, dtype=dtype)
    value_cache = torch.randn_like(key_cache)
    query = torch.randn(sum(q_lens), args.heads, d, device=device, dtype=dtype)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return (query, key_cache, value_cache, table, qsl.to(device), lens.to(device), d**-0.5)


def to_8bit(paged, kv_dtype: str) -> tuple[tuple, dict]:
    """The same pool written into an 8-bit cache: (paged args, {k_scale, v_scale})."""
    query, key_cache, value_cache = paged[:3]
    dtype = KV_8BIT[kv_dtype]
    nb, page, kvh, d = key_cache.shape
    codes = [torch.empty(key_cache.shape, dtype=dtype, device=key_cache.device) for _ in "kv"]
    if dtype == torch.int8:  # per token and head, written with the codes
        scales = [torch.empty(nb, page, kvh, dtype=torch.float16, device=key_cache.device) for _ in "kv"]
    else:  # per tensor: K and V are N(0, 1) here, so absmax ~5, placed at 448 / 16
        scales = [torch.full((1,), 5 * 16 / 448, device=key_cache.device) for _ in "kv"]
    slots = torch.arange(nb * page, device=key_cache.device)
    flat = (t.reshape(-1, kvh, d) for t in (key_cache, value_cache))
    write_kv_torch(*flat, *codes, slots, *scales)
    return (query, *codes, *paged[3:]), {"k_scale": scales[0], "v_scale": scales[1]}


def dense_of(paged, seq_len: int, q_len: int, scales: dict | None = None):
    """(B, H, q_len, D) queries and (B, Hkv, seq_len, D) K/V copied out of the pool (as the
    query's dtype, dequantized from an 8-bit cache), for equal-length sequences; filled one
    sequence at a time to keep the peak at one copy."""
    query, key_cache, value_cache, table = paged[:4]
    page, kvh, d = key_cache.shape[1:]
    nb, batch = math.ceil(seq_len / page), len(table)
    k = query.new_empty(batch, kvh, seq_len, d)
    v = torch.empty_like(k)
    for b in range(batch):
        blocks = table[b, :nb].long()
        for cache, name, out in ((key_cache, "k_scale", k), (value_cache, "v_scale", v)):
            part = cache[blocks]
            if scales:
                part = dequantize(part, gather_scale(scales[name], blocks), query.dtype)
            out[b] = part.reshape(-1, kvh, d)[:seq_len].transpose(0, 1)
    return query.view(batch, q_len, -1, d).transpose(1, 2), k, v


def sdpa_fn(dense, q_len: int, seq_len: int, scale: float) -> Callable[[], torch.Tensor]:
    """SDPA over dense K/V, returning (B, q_len, H, D).

    Decode: the `group` query heads of one KV head become `group` query rows of a non-causal
    attention over that head, so no backend has to repeat K/V. Prefill: SDPA's own causal
    mask without cached context, else an explicit mask (query i sees keys <= ctx + i)."""
    q, k, v = dense
    batch, heads, _, d = q.shape
    kvh = k.shape[1]
    if q_len == 1:
        qg = q.reshape(batch, kvh, heads // kvh, d)  # head h = kv_head * group + g
        return lambda: F.scaled_dot_product_attention(qg, k, v, scale=scale).reshape(batch, 1, heads, d)
    mask = None
    if q_len != seq_len:
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
    return lambda: F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
    ).transpose(1, 2)


def run_case(args, kind: str, batch: int, q_len: int, ctx: int, device: str, flush) -> list[dict]:
    """Time the three implementations on one batch of `batch` equal sequences, once per KV
    cache of --kv-cache-dtype ("auto": the 16-bit one)."""
    seq_len = ctx + q_len
    float_paged = make_paged(args, [q_len] * batch, [seq_len] * batch, device)
    rows = []
    for kv_dtype in args.kv_cache_dtype:
        paged, scales = (float_paged, {}) if kv_dtype == "auto" else to_8bit(float_paged, kv_dtype)
        row = time_case(args, kind, paged, scales, batch, q_len, ctx, device, flush)
        row["kv_cache_dtype"] = args.dtype if kv_dtype == "auto" else kv_dtype
        if rows and args.kv_cache_dtype[0] == "auto":
            row["speedup_vs_16bit"] = round(rows[0]["triton_ms"] / row["triton_ms"], 3)
        rows.append(row)
        del paged
    return rows


def time_case(args, kind, paged, scales, batch, q_len, ctx, device, flush) -> dict:
    seq_len = ctx + q_len
    dense = dense_of(paged, seq_len, q_len, scales)
    scale = paged[-1]
    out_triton = paged_attention_triton(*paged, **scales)
    out_sdpa = sdpa_fn(dense, q_len, seq_len, scale)()  # (B, q_len, H, D)
    err = (out_triton.float() - out_sdpa.reshape(out_triton.shape).float()).abs()
    ms = {
        "triton": time_ms(lambda: paged_attention_triton(*paged, **scales), device, flush),
        "torch_ref": time_ms(lambda: paged_attention_torch(*paged, **scales), device, flush),
        "sdpa": time_ms(sdpa_fn(dense, q_len, seq_len, scale), device, flush),
    }
    row = {"case": kind, "batch": batch, "q_len": q_len, "context": ctx, "device": device}
    row.update({f"{name}_ms": round(t, 4) for name, t in ms.items()})
    nsplit = choose_num_splits(batch * q_len, batch, args.kv_heads, torch.device(device))
    row["num_splits"] = nsplit
    row["max_abs_err_vs_sdpa"] = float(err.max())
    if kind == "decode":  # codes and, per token, their scales: what the kernel reads
        per_token = paged[1].element_size() * args.head_dim
        if scales and scales["k_scale"].dim() == 3:
            per_token += scales["k_scale"].element_size()
        kv_bytes = batch * seq_len * args.kv_heads * per_token * 2
        row["kv_bytes"] = kv_bytes
        for name, t in ms.items():
            row[f"{name}_bytes_per_s"] = sig4(kv_bytes / (t * 1e-3))
        row["triton_frac_peak_bw"] = sig4(kv_bytes / (ms["triton"] * 1e-3) / args.peak_bw)
    else:  # 2 matmuls x 2 flops per multiply-add, over the keys each query actually sees
        keys_seen = batch * sum(ctx + i + 1 for i in range(q_len))
        flops = 4 * args.heads * args.head_dim * keys_seen
        for name, t in ms.items():
            row[f"{name}_tflops"] = sig4(flops / (t * 1e-3) / 1e12)
    row["speedup_vs_torch_ref"] = round(ms["torch_ref"] / ms["triton"], 3)
    row["speedup_vs_sdpa"] = round(ms["sdpa"] / ms["triton"], 3)
    return row


def fits(args, batch: int, seq_len: int, q_len: int, device: str) -> bool:
    """Pool + dense copy + fp32 staging of one sequence in the torch reference, with slack."""
    if device != "cuda":
        return True
    elem = DTYPES[args.dtype].itemsize
    kv = batch * seq_len * args.kv_heads * args.head_dim * 2 * elem
    per_seq = seq_len * args.kv_heads * args.head_dim * 2 * 4 + q_len * seq_len * args.heads * 4
    free, _ = torch.cuda.mem_get_info()
    return 2 * kv + 4 * per_seq < 0.8 * free


def cases(args, smoke: bool):
    """(kind, batch, q_len, context) for the grid."""
    if smoke:
        return [("decode", 2, 1, 70), ("prefill", 1, 16, 0), ("prefill", 1, 8, 24)]
    decode = [("decode", b, 1, c) for c in (1024, 4096, 16384, 32768) for b in (1, 8, 64, 256)]
    prefill = [("prefill", 1, q, c) for q, c in ((512, 0), (2048, 0), (512, 4096), (2048, 8192))]
    return decode + prefill + [("prefill", 4, 2048, 0)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (always on without CUDA)")
    parser.add_argument("--peak-bw", type=float, default=4.8e12, help="peak HBM B/s (H200)")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page", type=int, default=16, help="KV block size in tokens")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        type=lambda t: t.split(","),
        help="KV caches to run each case on: auto (--dtype), int8, fp8_e4m3 (comma-separated)",
    )
    args = parser.parse_args()
    unknown = set(args.kv_cache_dtype) - {"auto", *KV_8BIT}
    if unknown:
        parser.error(f"--kv-cache-dtype: unknown {sorted(unknown)}; choose auto, int8, fp8_e4m3")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    smoke = args.smoke or device != "cuda"
    if device != "cuda":
        print("# no CUDA: smoke run in the Triton interpreter; timings are not kernel speed")
        args.heads, args.kv_heads, args.head_dim, args.dtype = 4, 2, 64, "float32"
    torch.manual_seed(0)
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device=device) if device == "cuda" else None
    for kind, batch, q_len, ctx in cases(args, smoke):
        if not fits(args, batch, ctx + q_len, q_len, device):
            print(json.dumps({"case": kind, "batch": batch, "context": ctx, "skipped": "memory"}))
            continue
        for row in run_case(args, kind, batch, q_len, ctx, device, flush):
            row.update(
                {
                    "heads": args.heads,
                    "kv_heads": args.kv_heads,
                    "head_dim": args.head_dim,
                    "page": args.page,
                    "dtype": args.dtype,
                    "smoke": smoke,
                }
            )
            print(json.dumps(row), flush=True)
        if device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
