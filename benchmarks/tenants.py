"""Two tenants on one group: does one tenant's burst delay the other's requests?

    python -m benchmarks.tenants
    python -m benchmarks.tenants --quick     # a shorter trace (smoke)
    python -m benchmarks.tenants --quick --flood-docs 30 --ratio 2   # and the cache flood

One simulated group (cluster/sim_group.py: the real scheduler and block manager, a cost model
for the forward) serves the research-assistant trace (benchmarks/workloads.py) for two tenants:
tenant B at `--rate-b` requests/s, tenant A at `--ratio` times that, past what the group can
serve, so that A's queue grows for the whole run. Cases, in the same run:

- `b_alone`: B's requests with nobody else;
- `fifo`: both, every request of the one tenant "" (what the group did before it knew tenants:
  first come, first served);
- `fair`: both, as tenants A and B of equal weight (worker/engine/fair_queue.py);
- `fair_bounded`: as `fair`, with a step's prompt tokens for the tenant over its share of the
  running requests bounded at 128 (SchedulerConfig.over_share_prefill_tokens);
- the cache flood (`--flood-docs`): B asks about its 3 documents while A's trace spans
  documents totalling 10x A's KV quota, on a pool that holds B's and a part of A's:
  `flood_b_alone`, `flood_lru` (no quotas: the global LRU) and `flood_quotas` (A's and B's
  `kv_quota`, worker/engine/block_manager.py), with each tenant's prefix hit rate and the
  cached blocks A's requests evicted of each tenant.

One JSON line per case with each tenant's TTFT p50/p99 (simulated seconds), requests finished,
output tokens/s, its share of the tokens the group computed and of the pool's blocks at the
end (`cache_share`; first come first served knows no tenants: both read the whole), and B's TTFT p99 over
`b_alone`'s (the goal: <= 1.25 with fairness; A keeps at least its weighted share, half).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics

from benchmarks.workloads import ResearchWorkload, research_requests
from cluster.sim_group import SimGroup, SimGroupConfig
from worker.config import SchedulerConfig
from worker.hashing import BlockHasher, ModelFingerprint
from worker.protocol import QueueFullError

BLOCK_SIZE = 16


def arrivals(
    rate: float, duration: float, tenant: str, seed: int, num_docs: int = 6, **shape
) -> list[tuple[float, str, tuple, int]]:
    """Poisson arrivals of `tenant`'s research trace (its own documents; `shape`: other
    ResearchWorkload fields), cycled to fill `duration` seconds: (time, tenant, prompt, output
    tokens)."""
    rng = random.Random(seed)
    trace = research_requests(ResearchWorkload(num_docs=num_docs, seed=seed, **shape))
    out, t, i = [], 0.0, 0
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            return out
        r = trace[i % len(trace)]
        out.append((t, tenant, r.prompt, r.max_tokens))
        i += 1


def run_case(
    requests: list,
    fair: bool,
    num_blocks: int,
    weights: dict[str, float],
    kv_quotas: dict[str, int] | None = None,
    bound: int | None = None,
) -> dict[str, dict]:
    """Replay `requests` (time-ordered) on one simulated group; per tenant of the trace: TTFTs,
    tokens, prefix hits. Without `fair` every request reaches the group as the one tenant ""."""
    hasher = BlockHasher(b"bench", ModelFingerprint("bench", block_size=BLOCK_SIZE))
    sched = SchedulerConfig(
        max_num_batched_tokens=2048,
        max_num_seqs=64,
        tenant_weights=weights if fair else {},
        over_share_prefill_tokens=bound,
    )
    group = SimGroup("g0", SimGroupConfig(num_blocks, BLOCK_SIZE, sched, kv_quotas=kv_quotas), hasher)
    prompts: dict[str, int] = {}
    hits: dict[str, int] = {}
    tenant_of, output_of = {}, {}
    ttfts: dict[str, list[float]] = {}
    tokens: dict[str, int] = {}
    computed: dict[str, int] = {}
    refused: dict[str, int] = {}
    pending = list(reversed(requests))
    now, end = 0.0, requests[-1][0] if requests else 0.0
    while pending or group.busy_until is not None:
        next_arrival = pending[-1][0] if pending else float("inf")
        if group.busy_until is not None and group.busy_until <= next_arrival:
            now = group.busy_until
            for rec in group.end_step():
                tokens[tenant_of[rec.request_id]] = tokens.get(tenant_of[rec.request_id], 0) + output_of[rec.request_id]
            for rec in group.started:
                ttfts.setdefault(tenant_of[rec.request_id], []).append(rec.ttft_s)
                t = tenant_of[rec.request_id]
                computed[t] = computed.get(t, 0) + (rec.prompt_tokens - max(rec.cached_tokens, 0))
                prompts[t] = prompts.get(t, 0) + rec.prompt_tokens
                hits[t] = hits.get(t, 0) + max(rec.cached_tokens, 0)
            group.started.clear()
        else:
            now, tenant, prompt, max_tokens = pending.pop()
            rid = f"{tenant}-{len(tenant_of)}"
            tenant_of[rid], output_of[rid] = tenant, max_tokens
            try:
                group.submit(rid, list(prompt), max_tokens, now, tenant=tenant if fair else "")
            except QueueFullError:  # (what a door answers RESOURCE_EXHAUSTED)
                refused[tenant] = refused.get(tenant, 0) + 1
        if group.busy_until is None:
            if now > end and not pending and not group.scheduler.has_unfinished():
                break
            group.start_step(now)
    bm = group.scheduler.bm
    held: dict[str, int] = {}  # tenant -> the pool's cached blocks its requests computed, at the end
    for block in bm.cached.values():
        held[block.tenant] = held.get(block.tenant, 0) + 1
    return {
        t: {
            "hit_rate": round(hits.get(t, 0) / max(prompts.get(t, 0), 1), 3),
            "cache_share": round(held.get(t if fair else "", 0) / num_blocks, 3),
            "evictions_suffered": bm.evictions_suffered.get(t, 0),
            "ttft_s_p50": round(statistics.median(ttfts.get(t, [0.0])), 3),
            "ttft_s_p99": round(_pct(ttfts.get(t, [0.0]), 0.99), 3),
            "finished_output_tokens_per_s": round(tokens.get(t, 0) / max(now, 1e-9), 1),
            "prompt_tokens_computed": computed.get(t, 0),
            "refused_queue_full": refused.get(t, 0),
        }
        for t in sorted(set(tenant_of.values()))
    }


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate-b", type=float, default=10.0, help="tenant B's requests/s")
    p.add_argument("--ratio", type=float, default=10.0, help="tenant A's rate over B's")
    p.add_argument("--duration", type=float, default=30.0, help="simulated seconds of arrivals")
    p.add_argument("--blocks", type=int, default=8192, help="the group's KV blocks")
    p.add_argument("--quick", action="store_true", help="a shorter trace (smoke)")
    p.add_argument("--flood-docs", type=int, default=0, help="A's documents in the cache flood (0: no flood)")
    p.add_argument("--flood-blocks", type=int, default=1024, help="the group's KV blocks in the cache flood")
    p.add_argument("--real", action="store_true", help="and the fairness cases on one real engine (built-in model)")
    p.add_argument("--real-rate-b", type=float, default=5.0, help="tenant B's requests/s on the real engine")
    p.add_argument("--real-duration", type=float, default=20.0, help="seconds of arrivals on the real engine")
    args = p.parse_args()
    duration = 20.0 if args.quick else args.duration
    b = arrivals(args.rate_b, duration, "B", seed=1)
    a = arrivals(args.rate_b * args.ratio, duration, "A", seed=2)
    both = sorted(a + b, key=lambda r: r[0])
    weights = {"A": 1.0, "B": 1.0}
    alone = run_case(b, True, args.blocks, weights)["B"]
    common = {"bench": "tenants", "rate_b": args.rate_b, "ratio": args.ratio, "duration_s": duration}
    print(json.dumps({**common, "case": "b_alone", "B": alone}))
    for case, fair, bound in (("fifo", False, None), ("fair", True, None), ("fair_bounded", True, 128)):
        got = run_case(both, fair, args.blocks, weights, bound=bound)  # (figures by the trace's tenant either way)
        total = sum(v["prompt_tokens_computed"] for v in got.values()) or 1
        for v in got.values():
            v["computed_share"] = round(v["prompt_tokens_computed"] / total, 3)
        ratio = round(got["B"]["ttft_s_p99"] / max(alone["ttft_s_p99"], 1e-9), 2)
        print(json.dumps({**common, "case": case, "A": got["A"], "B": got["B"], "b_ttft_p99_vs_alone": ratio}))
    if args.flood_docs:
        flood(args, duration)
    if args.real:
        real(args)


def flood(args: argparse.Namespace, duration: float) -> None:
    """The cache flood cases: B's 3 documents against A's `--flood-docs`, A at `--ratio`x B's
    rate; quotas: B 3/8 of the pool (its documents fit), A a tenth of its documents' blocks."""
    b = arrivals(args.rate_b, duration, "B", seed=1, num_docs=3)
    a = arrivals(args.rate_b * args.ratio, duration, "A", seed=2, num_docs=args.flood_docs)
    both = sorted(a + b, key=lambda r: r[0])
    a_blocks = args.flood_docs * 1250 // BLOCK_SIZE  # (the trace's documents: 1,000-1,500 tokens)
    quotas = {"A": min(args.flood_blocks // 4, a_blocks // 10), "B": args.flood_blocks * 3 // 8}
    weights = {"A": 1.0, "B": 1.0}
    common = {"bench": "tenants", "rate_b": args.rate_b, "ratio": args.ratio, "duration_s": duration}
    common |= {"blocks": args.flood_blocks, "a_docs": args.flood_docs, "b_docs": 3, "kv_quotas": quotas}
    bound = SchedulerConfig().over_share_prefill_tokens  # (the engine's default)
    alone = run_case(b, True, args.flood_blocks, weights, bound=bound)["B"]
    print(json.dumps({**common, "case": "flood_b_alone", "B": alone}))
    lru = run_case(both, True, args.flood_blocks, weights, bound=bound)
    print(json.dumps({**common, "case": "flood_lru", "A": lru["A"], "B": lru["B"]}))
    got = run_case(both, True, args.flood_blocks, weights, quotas, bound=bound)
    ratio = round(got["B"]["hit_rate"] / max(lru["B"]["hit_rate"], 1e-9), 2)
    print(json.dumps({**common, "case": "flood_quotas", "A": got["A"], "B": got["B"], "b_hit_rate_vs_lru": ratio}))


# The real engine's trace: shorter documents and answers than the simulation's, so that the
# built-in model on a CPU saturates at a few requests a second.
REAL_SHAPE = dict(doc_len=(300, 500), question_len=(16, 32), output_len=(8, 32), vocab_size=1000)


def real(args: argparse.Namespace) -> None:
    """The fairness cases on one real engine in this process (the built-in model, float32, on
    this machine's CPU): tenant B at `--real-rate-b`, A at `--ratio` times that, replayed in
    wall-clock time; TTFT from each request's arrival to its first token. `real_b_alone`,
    `real_fifo`, `real_fair_bounded` (the defaults: weighted fair queue, bounded prefill)."""
    duration = args.real_duration
    b = arrivals(args.real_rate_b, duration, "B", seed=1, num_docs=3, **REAL_SHAPE)
    a = arrivals(args.real_rate_b * args.ratio, duration, "A", seed=2, num_docs=3, **REAL_SHAPE)
    both = sorted(a + b, key=lambda r: r[0])
    common = {"bench": "tenants", "engine": "real", "model": "builtin", "rate_b": args.real_rate_b}
    common |= {"ratio": args.ratio, "duration_s": duration}
    alone = run_real(b, fair=True)["B"]
    print(json.dumps({**common, "case": "real_b_alone", "B": alone}), flush=True)
    for case, fair in (("real_fifo", False), ("real_fair_bounded", True)):
        got = run_real(both, fair)
        ratio = round(got["B"]["ttft_s_p99"] / max(alone["ttft_s_p99"], 1e-9), 2)
        print(
            json.dumps({**common, "case": case, "A": got["A"], "B": got["B"], "b_ttft_p99_vs_alone": ratio}), flush=True
        )


def run_real(requests: list, fair: bool) -> dict[str, dict]:
    """Replay `requests` on a fresh engine (LLMEngine, stepped here) at their arrival times;
    per tenant: TTFTs (wall seconds), finished output tokens/s, prefix hit rate. Without
    `fair` every request reaches the engine as the one tenant "" (first come, first served)."""
    import time

    from pagefleet.llm import LLM
    from worker.sampling_params import SamplingParams

    llm = LLM("builtin", dtype="float32", num_blocks=2048, max_model_len=1024, max_num_batched_tokens=512)
    engine = llm.engine
    tenant_of, arrived, first, tokens, prompts, hits = {}, {}, {}, {}, {}, {}
    pending = list(reversed(requests))
    t0 = time.perf_counter()
    while pending or engine.has_unfinished():
        now = time.perf_counter() - t0
        while pending and pending[-1][0] <= now:
            at, tenant, prompt, max_tokens = pending.pop()
            rid = f"{tenant}-{len(tenant_of)}"
            tenant_of[rid], arrived[rid] = tenant, at
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            engine.add_request(list(prompt), params, request_id=rid, tenant=tenant if fair else "")
        if not engine.has_unfinished():
            time.sleep(max(0.0, min(0.01, pending[-1][0] - now)))
            continue
        for out in engine.step():
            rid, t = out.request_id, tenant_of[out.request_id]
            if rid not in first and out.new_token_ids:
                first[rid] = time.perf_counter() - t0 - arrived[rid]
                prompts[t] = prompts.get(t, 0) + len(out.prompt_token_ids)
                hits[t] = hits.get(t, 0) + max(out.num_cached_tokens, 0)
            if out.finished:
                tokens[t] = tokens.get(t, 0) + len(out.token_ids)
    elapsed = time.perf_counter() - t0
    llm.shutdown()
    ttfts: dict[str, list[float]] = {}
    for rid, ttft in first.items():
        ttfts.setdefault(tenant_of[rid], []).append(ttft)
    return {
        t: {
            "requests": len(ttfts.get(t, [])),
            "hit_rate": round(hits.get(t, 0) / max(prompts.get(t, 0), 1), 3),
            "ttft_s_p50": round(statistics.median(ttfts.get(t, [0.0])), 3),
            "ttft_s_p99": round(_pct(ttfts.get(t, [0.0]), 0.99), 3),
            "finished_output_tokens_per_s": round(tokens.get(t, 0) / max(elapsed, 1e-9), 1),
        }
        for t in sorted(set(tenant_of.values()))
    }


if __name__ == "__main__":
    main()
