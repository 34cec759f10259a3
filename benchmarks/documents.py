"""A pinned document against a flood: does a tenant's document stay warm while others churn
the pool?

    python -m benchmarks.documents
    python -m benchmarks.documents --quick     # smaller sizes (smoke)

One real CPU group (the built-in model unless `--model`) with a small pool, behind the router
in this process. Each round, a flood of other prompts (more blocks than the pool holds) runs,
then one question on the document (its text and a few more tokens). Cases, in the same run:

- `unpinned`: the document was asked about once before the first round (so cached), nothing
  more: the flood evicts it, and each question prefills it again;
- `pinned`: the document was put (router/documents.py) first: its blocks are pinned.

One JSON line per case with the questions' cached-token share (hit rate), TTFT p50/max, the
flood's requests, and the pinned case's TTFT p50 over the unpinned case's (`ratio_vs_peer`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from cluster.index import InMemoryPrefixIndex
from cluster.local_group import LocalGroup
from pagefleet.llm import engine_config
from router.launch.local import router_side
from router.router import Router, RouteRequest
from worker.sampling_params import SamplingParams
from worker.token_ids import check_token_ids

BLOCK_SIZE = 16


def tokens(seed: int, n: int, vocab: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % (vocab - 10) + 5 for i in range(n)]


async def ask(router: Router, prompt: list[int]) -> tuple[float, int]:
    """(TTFT in seconds, cached tokens) of a one-token request."""
    t0 = time.perf_counter()
    req = RouteRequest(prompt_token_ids=prompt, params=SamplingParams(max_tokens=1, temperature=0.0))
    outs = [out async for out in router.generate(req)]
    return time.perf_counter() - t0, outs[-1].num_cached_tokens


async def run_case(args, pinned: bool) -> dict:
    config = engine_config(
        args.model, num_blocks=args.num_blocks, block_size=BLOCK_SIZE, max_model_len=args.max_model_len
    )
    index = InMemoryPrefixIndex()
    group = LocalGroup(config, index, group_id="g0")
    try:
        hasher, _, info = router_side(config, args.model)
        router = Router([group], index, hasher, info)
        doc = tokens(1, args.doc_tokens, info.vocab_size)
        if pinned:
            await router.documents.put(check_token_ids(doc, info.vocab_size)[1], None, "", ttl_s=600)
        else:
            await ask(router, doc)
        ttfts, cached, flood = [], [], 0
        for r in range(args.rounds):
            for f in range(args.flood):
                await ask(router, tokens(1000 + r * args.flood + f, args.flood_tokens, info.vocab_size))
                flood += 1
            ttft, hit = await ask(router, doc + tokens(500 + r, 8, info.vocab_size))
            ttfts.append(ttft)
            cached.append(hit)
        full = args.doc_tokens // BLOCK_SIZE * BLOCK_SIZE
        router.documents.close()
        return {
            "case": "pinned" if pinned else "unpinned",
            "model": args.model,
            "num_blocks": args.num_blocks,
            "doc_tokens": args.doc_tokens,
            "rounds": args.rounds,
            "flood_requests": flood,
            "flood_blocks_per_round": args.flood * -(-args.flood_tokens // BLOCK_SIZE),
            "hit_rate": round(sum(cached) / (full * len(cached)), 3),
            "ttft_p50_ms": round(1000 * statistics.median(ttfts), 1),
            "ttft_max_ms": round(1000 * max(ttfts), 1),
        }
    finally:
        group.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin")
    parser.add_argument("--num-blocks", type=int, default=96)
    parser.add_argument("--max-model-len", type=int, default=768)
    parser.add_argument("--doc-tokens", type=int, default=640)
    parser.add_argument("--flood", type=int, default=4, help="flood requests before each question")
    parser.add_argument("--flood-tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="smaller sizes (smoke)")
    args = parser.parse_args()
    if args.quick:
        args.num_blocks, args.max_model_len, args.doc_tokens = 48, 256, 128
        args.flood, args.flood_tokens, args.rounds = 4, 240, 2
    lines = [asyncio.run(run_case(args, pinned)) for pinned in (False, True)]
    lines[1]["ratio_vs_peer"] = round(lines[1]["ttft_p50_ms"] / lines[0]["ttft_p50_ms"], 3)
    lines[1]["peer"] = "unpinned"
    for line in lines:
        print(json.dumps(line))


if __name__ == "__main__":
    main()
