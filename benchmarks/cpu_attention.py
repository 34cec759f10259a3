"""CPU attention: pagefleet's torch path (kernels/torch_sdpa.py) against torch's fused
`scaled_dot_product_attention` on the same paged K/V, in float32 and bfloat16. One JSON line per
case and dtype, with the same-run ratio against fused SDPA.

    python benchmarks/cpu_attention.py            # SmolLM2-135M's heads: 9 query, 3 KV, dim 64

Cases: a decode batch (one query per sequence, contexts of 1000-1500 tokens, padded to the
longest as a fused call needs), a fresh causal prefill and a prefill chunk over cached context.
The peer is what the CPU path ran before: each case's blocks gathered out of the pool into fresh
tensors, then one fused SDPA call. pagefleet gathers into its reused workspace, as the torch
backend does. Both times include the gathers. One torch thread by default, as
benchmarks/engine.py.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.torch_sdpa import Workspace, paged_attention_sdpa  # noqa: E402

BLOCK = 16


def time_ms(fn, repeat: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def paged(q_lens: list[int], seq_lens: list[int], heads: int, kvh: int, d: int, dtype, seed=0):
    """Query, a pool holding each sequence's K/V in scattered blocks, and the arguments of
    paged attention over it."""
    g = torch.Generator().manual_seed(seed)
    nblocks = [-(-n // BLOCK) for n in seq_lens]
    k_pool = torch.randn(sum(nblocks), BLOCK, kvh, d, generator=g).to(dtype)
    v_pool = torch.randn(sum(nblocks), BLOCK, kvh, d, generator=g).to(dtype)
    order = torch.randperm(sum(nblocks), generator=g)
    tables = torch.zeros(len(seq_lens), max(nblocks), dtype=torch.int32)
    used = 0
    for s, nb in enumerate(nblocks):
        tables[s, :nb] = order[used : used + nb].int()
        used += nb
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(int(qsl[-1]), heads, d, generator=g).to(dtype)
    return query, k_pool, v_pool, tables, qsl, torch.tensor(seq_lens, dtype=torch.int32)


def fused(query, k_pool, v_pool, tables, qsl, lens) -> torch.Tensor:
    """The peer, as the CPU path ran before: gather each case's blocks, then one fused SDPA
    call (decodes: K/V padded to the longest context with a padding mask; a prefill: causal
    against its cached context). Returns (tokens, heads, d)."""
    n, nb = tables.shape
    kvh, d = k_pool.shape[2], k_pool.shape[3]
    seq_lens, q_len = lens.tolist(), int(qsl[1] - qsl[0])
    blocks = tables.reshape(-1).long()
    k, v = (p.index_select(0, blocks).view(n, nb * BLOCK, kvh, d) for p in (k_pool, v_pool))
    k, v = k[:, : max(seq_lens)].transpose(1, 2), v[:, : max(seq_lens)].transpose(1, 2)
    if q_len == 1:  # a decode batch: (n, h, 1, d) queries
        mask = torch.arange(k.shape[2])[None, :] < lens[:, None]
        q = query.view(n, -1, 1, d)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :], enable_gqa=True)
        return o[:, :, 0]
    q = query.transpose(0, 1)[None]  # one prefill: (1, h, q, d)
    if q_len == seq_lens[0]:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    else:
        q_pos = torch.arange(seq_lens[0] - q_len, seq_lens[0])
        mask = torch.arange(seq_lens[0])[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    return o[0].transpose(0, 1)


def cases(batch: int) -> dict[str, tuple[list[int], list[int]]]:
    g = torch.Generator().manual_seed(1)
    contexts = torch.randint(1000, 1501, (batch,), generator=g).tolist()
    return {
        f"decode_{batch}x1000-1500": ([1] * batch, contexts),
        "prefill_1400": ([1400], [1400]),
        "prefill_600_after_800": ([600], [1400]),
    }


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=12, help="sequences of the decode case")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    lines = []
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for case, (q_lens, seq_lens) in cases(args.batch).items():
            batch = paged(q_lens, seq_lens, args.heads, args.kv_heads, args.head_dim, dtype)
            scale = args.head_dim**-0.5  # fused SDPA's default scale, as the peer uses

            def ours(batch=batch, scale=scale, workspace=Workspace()):
                return paged_attention_sdpa(*batch, scale=scale, workspace=workspace)

            ours_ms = time_ms(ours, args.repeat)
            peer_ms = time_ms(lambda batch=batch: fused(*batch), args.repeat)
            diff = (ours().float() - fused(*batch).float()).abs().max()
            line = {
                "bench": "cpu_attention",
                "case": case,
                "dtype": dtype_name,
                "heads": args.heads,
                "kv_heads": args.kv_heads,
                "head_dim": args.head_dim,
                "torch_threads": torch.get_num_threads(),
                "pagefleet_ms": round(ours_ms, 3),
                "fused_sdpa_ms": round(peer_ms, 3),
                "ratio_vs_fused_sdpa": round(peer_ms / ours_ms, 2),
                "max_abs_diff": float(f"{float(diff):.3g}"),
            }
            print(json.dumps(line), flush=True)
            lines.append(line)
    return lines


if __name__ == "__main__":
    main()
