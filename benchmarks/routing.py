"""Routing benchmark: hit rate, load balance, TTFT and decision latency per placement policy.

    python -m benchmarks.routing --trace T.jsonl --groups 16 --policy all --mode sim --plot r.svg
    python -m benchmarks.routing --trace T.jsonl --groups 2 --policy all --mode real
    python -m benchmarks.routing --latency 4,16,64
    python -m benchmarks.routing --calibrate --cost-out cost.json

Every policy replays the same trace against fresh groups and prints one JSON line; `all` runs the
router's policies and `oracle_balanced`, the clairvoyant placement under the load bound
(benchmarks/oracles.py). `--mode sim`
runs simulated groups (cluster/sim_group.py: the real scheduler and block manager, a calibrated
cost model for the forward) in simulated time, by default over the in-process index on the
simulated clock (heartbeats and pending TTLs in simulated seconds; `--index redis` puts a real
`redis-server` on loopback behind it, whose TTLs run on the wall clock); `--mode real` runs
LocalGroups with the built-in model on this CPU publishing to Redis, routed on a mirror of it as
`pagefleet serve` does, and takes hit rates from the cached tokens the engines report.

`--latency G,...` measures what the router adds to a request (benchmarks/routing_latency.py)
against a real `redis-server` on loopback holding G groups' inventories, at 8k- and 32k-token
prompts that extend a cached document with a new question: the decision (`Router.place`) over
the plain Redis index (one round trip) and over the router's mirror of it (none), the hashing,
and their sum, `overhead`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import time
import uuid
from collections import Counter
from pathlib import Path

from tqdm import tqdm

from benchmarks.oracles import BalancedOracle, Oracle
from benchmarks.plot import routing_svg
from benchmarks.routing_latency import SECRET, decision_latency, pct, run_latency
from benchmarks.traces import TraceRequest, read
from cluster.cost_model import CostModel
from cluster.index import InMemoryPrefixIndex, MirroredPrefixIndex, RedisPrefixIndex
from cluster.local_group import LocalGroup
from cluster.sim_group import Arrival, SimClock, SimGroup, SimGroupConfig, Simulation
from router.placement import POLICIES, PrefixAware, PrefixAwareConfig, make_policy
from router.router import ModelInfo, Router, RouteRequest
from tests.redis_server import RedisServer
from worker.config import SchedulerConfig
from worker.hashing import BlockHasher, ModelFingerprint
from worker.sampling_params import SamplingParams

# the router's policies, then the benchmark's clairvoyant peer under the load bound
NAMES = [*sorted([*POLICIES, Oracle.name]), BalancedOracle.name]


def spread(counts: Counter, groups: list[str]) -> dict:
    values = [counts.get(g, 0) for g in groups]
    mean = sum(values) / len(values)
    return {"per_group": values, "max_over_mean": round(max(values) / mean, 3) if mean else None}


def make_router(groups, index, hasher, block_size: int, policy_name: str, cost: CostModel, tuning: dict | None = None, trace: str | None = None, batch_tokens: int = 2048):  # fmt: skip
    if policy_name == "prefix_aware":
        policy = PrefixAware(PrefixAwareConfig(cost=cost, **(tuning or {})), block_size, batch_tokens)  # fmt: skip
    elif policy_name == BalancedOracle.name:  # plans over the whole trace first
        policy = BalancedOracle.plan(read(trace), [g.group_id for g in groups], block_size=block_size)  # fmt: skip
    elif policy_name == Oracle.name:
        policy = Oracle(block_size)
    else:
        policy = make_policy(policy_name, block_size, batch_tokens)
    info = ModelInfo("bench", max_model_len=1 << 20, block_size=block_size, kv_cache_dtype="auto", vocab_size=1 << 20)  # fmt: skip
    return Router(groups, index, hasher, info, policy=policy)


def summarize(name, rows, groups, decisions, extra) -> dict:
    """rows: (group, prompt_tokens, predicted_cached, actual_cached, ttft_s, prefill_tokens)."""
    prompt = sum(r[1] for r in rows)
    actual = sum(r[3] for r in rows)
    agree = sum(1 for r in rows if r[2] == r[3])
    ttfts = [r[4] for r in rows if r[4] is not None]
    return {
        "policy": name,
        "requests": len(rows),
        "hit_rate": round(actual / prompt, 4) if prompt else None,
        "predicted_hit_rate": round(sum(r[2] for r in rows) / prompt, 4) if prompt else None,
        "predicted_equals_actual": round(agree / len(rows), 4) if rows else None,
        "requests_per_group": spread(Counter(r[0] for r in rows), groups),
        "prefill_tokens_per_group": spread(
            Counter({g: v for g, v in extra.pop("prefill").items()}), groups
        ),  # fmt: skip
        "ttft_s_p50": round(pct(ttfts, 0.5), 4) if ttfts else None,
        "ttft_s_p99": round(pct(ttfts, 0.99), 4) if ttfts else None,
        "decision_ms_p50_trace": round(1e3 * pct(decisions, 0.5), 3),
        "decision_ms_p99_trace": round(1e3 * pct(decisions, 0.99), 3),
        **extra,
    }


# ---- simulated groups ----------------------------------------------------------------------
def run_sim(args, policy_name: str, server: RedisServer | None, cost: CostModel) -> dict:
    hasher = BlockHasher(SECRET, ModelFingerprint("bench", block_size=args.block_size))
    clock = SimClock() if server is None else None
    if clock is not None:  # liveness and pending TTLs in simulated seconds
        index = InMemoryPrefixIndex(clock=clock)
    else:
        index = RedisPrefixIndex.from_url(server.url, f"sim{uuid.uuid4().hex[:8]}", "bench")
    sched = SchedulerConfig(max_model_len=1 << 20, max_num_batched_tokens=args.batch_tokens)
    cfg = SimGroupConfig(args.blocks, args.block_size, sched, cost)
    groups = [SimGroup(f"g{i:02d}", cfg, hasher, index, clock or time.monotonic) for i in range(args.groups)]  # fmt: skip
    router = make_router(groups, index, hasher, args.block_size, policy_name, cost, args.tuning, args.trace, args.batch_tokens)  # fmt: skip
    predicted, decisions, last_doc = {}, [], [[]]
    doc_hashes: dict[tuple, list[bytes]] = {}

    def arrivals():
        for r in tqdm(read(args.trace), desc=policy_name, unit="req", leave=False, disable=None):
            hashes = None
            if r.doc is not None:  # the document's blocks are hashed once per tenant
                key = (r.doc, r.tenant)
                if key not in doc_hashes:
                    doc_hashes[key] = hasher.hash_prompt(r.prompt_token_ids[: r.doc_tokens], cache_salt=r.tenant)  # fmt: skip
                head = doc_hashes[key]
                parent = head[-1] if head else hasher.root(None, r.tenant)
                hashes = head + hasher.hash_blocks(r.prompt_token_ids, parent, len(head))
                last_doc[0] = r.prompt_token_ids[: r.doc_tokens]
            yield Arrival(r.id, r.arrival_s, r.prompt_token_ids, r.max_tokens, r.tenant, r.doc, hashes)  # fmt: skip

    def place(a: Arrival, hashes: list[bytes]) -> SimGroup:
        if isinstance(router.policy, Oracle):
            router.policy.expect(a.key, len(a.prompt))
        t0 = time.perf_counter()
        p = router.place(hashes)
        decisions.append(time.perf_counter() - t0)
        predicted[a.request_id] = min(p.cached_blocks * args.block_size, len(a.prompt) - 1)
        return router.groups[p.group_id]

    wall = time.perf_counter()
    done = Simulation(groups, hasher, clock=clock).run(arrivals(), place)
    wall = time.perf_counter() - wall
    rows = [(d.group_id, d.prompt_tokens, predicted[d.request_id], d.cached_tokens, d.ttft_s, 0) for d in done]  # fmt: skip
    extra = {"prefill": {g.group_id: g.prefill_tokens for g in groups}, "mode": "sim", "index": args.index, "groups": args.groups, "wall_s": round(wall, 1)}  # fmt: skip
    if server is not None:
        extra.update(decision_latency(router, last_doc[0], hasher, n=40))
    router.ledger.pending.flush()
    for g in groups:
        g.shutdown()
    index.close()
    if policy_name == "prefix_aware" and args.tuning:
        extra["tuning"] = args.tuning
    return summarize(policy_name, rows, [g.group_id for g in groups], decisions, extra)


# ---- real groups on this CPU ------------------------------------------------------------------
def run_real(args, policy_name: str, server: RedisServer, cost: CostModel) -> dict:
    from pagefleet.llm import engine_config

    ns = f"real{uuid.uuid4().hex[:8]}"
    index = RedisPrefixIndex.from_url(server.url, ns, "bench")  # the groups'
    routed = MirroredPrefixIndex(RedisPrefixIndex.from_url(server.url, ns, "bench"))  # the router's
    config = engine_config("builtin", num_blocks=args.blocks, block_size=args.block_size, cluster_secret=SECRET, max_num_batched_tokens=args.batch_tokens, max_model_len=min(4096, args.blocks * args.block_size))  # fmt: skip
    groups = [LocalGroup(config, index, group_id=f"g{i}") for i in range(args.groups)]
    hasher = groups[0].hasher
    router = make_router(groups, routed, hasher, args.block_size, policy_name, cost, trace=args.trace, batch_tokens=args.batch_tokens)  # fmt: skip
    reqs = list(read(args.trace))
    rows: list = []
    decisions: list[float] = []

    async def one(r: TraceRequest, t0: float) -> None:
        await asyncio.sleep(max(0.0, t0 + r.arrival_s * args.time_scale - time.perf_counter()))
        if isinstance(router.policy, Oracle):
            router.policy.expect(r.doc, len(r.prompt_token_ids))
        start = time.perf_counter()
        req = RouteRequest(prompt_token_ids=r.prompt_token_ids, params=SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True), request_id=r.id, cache_salt=r.tenant)  # fmt: skip
        ttft = None
        async for _out in router.generate(req):
            ttft = ttft if ttft is not None else time.perf_counter() - start
        rec = router.records[r.id]
        decisions.append(rec.decision_seconds)
        rows.append((rec.group_id, len(r.prompt_token_ids), rec.predicted_cached_tokens, rec.actual_cached_tokens, ttft, 0))  # fmt: skip

    async def replay() -> None:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(r, t0) for r in reqs))

    asyncio.run(replay())
    prefill = {g.group_id: g.status().prefix_cache_queries - g.status().prefix_cache_hits for g in groups}  # fmt: skip
    extra = {"prefill": prefill, "mode": "real", "groups": args.groups}
    docs = [r.prompt_token_ids[: r.doc_tokens] for r in reqs if r.doc]
    extra.update(decision_latency(router, docs[-1] if docs else [], hasher, n=20))
    router.ledger.pending.flush()
    for g in groups:
        g.shutdown()
    routed.close()
    index.close()
    return summarize(policy_name, rows, [g.group_id for g in groups], decisions, extra)


# ---- calibration --------------------------------------------------------------------------
def calibrate(block_size: int = 16) -> CostModel:
    """Fit the cost model to steps of the real engine (built-in model, this CPU)."""
    from pagefleet.llm import engine_config
    from worker.engine import LLMEngine

    engine = LLMEngine(engine_config("builtin", num_blocks=1024, block_size=block_size, enable_prefix_caching=False))  # fmt: skip
    rng, samples = random.Random(0), []
    for prefill, decodes in [(0, 1), (0, 8), (0, 32), (256, 0), (1024, 0), (2048, 0), (512, 16)]:
        for _ in range(3):
            for _ in range(decodes):  # decoding sequences: admitted, prefilled, one token out
                engine.add_request([rng.randrange(1000) for _ in range(8)], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))  # fmt: skip
            while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running):  # fmt: skip
                engine.step()
            if prefill:
                engine.add_request([rng.randrange(1000) for _ in range(prefill)], SamplingParams(max_tokens=1, temperature=0.0))  # fmt: skip
            t0 = time.perf_counter()
            engine.step()
            samples.append((prefill, decodes, time.perf_counter() - t0))
            engine.abort([r.request_id for r in list(engine.scheduler.requests.values())])
    return CostModel.fit(samples)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--trace")
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--policy", default="all", help=f"one of {NAMES} or 'all'")
    p.add_argument("--mode", choices=("sim", "real"), default="sim")
    p.add_argument("--blocks", type=int, default=2048, help="KV blocks per group")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--batch-tokens", type=int, default=2048)
    p.add_argument("--time-scale", type=float, default=1.0, help="real mode: wall s per trace s")
    p.add_argument("--cost", help="cost model JSON (from --calibrate); default: built in")
    p.add_argument("--index", choices=("memory", "redis"), default="memory", help="sim mode's index")  # fmt: skip
    p.add_argument("--tuning", type=json.loads, default={}, help="PrefixAwareConfig fields, JSON")
    p.add_argument("--latency", help="comma-separated group counts: decision latency over Redis")
    p.add_argument("--calibrate", action="store_true")
    p.add_argument("--cost-out")
    p.add_argument("--plot", help="also write the policies' results as an SVG (benchmarks/plot.py)")
    args = p.parse_args(argv)
    if args.calibrate:
        cost = calibrate(args.block_size)
        print(json.dumps({"cost_model": cost.__dict__}))
        if args.cost_out:
            with open(args.cost_out, "w") as f:
                json.dump(cost.__dict__, f)
        return
    cost = CostModel(**json.loads(Path(args.cost).read_text())) if args.cost else CostModel()
    if args.latency:
        with RedisServer() as server:
            for n in (int(x) for x in args.latency.split(",")):
                for kind in ("redis", "mirror", "memory"):
                    print(json.dumps(run_latency(args, server, n, cost, kind)), flush=True)
        return
    if not args.trace:
        p.error("--trace is required (generate one with python -m benchmarks.traces)")
    if args.policy not in (*NAMES, "all"):
        p.error(f"--policy must be one of {NAMES} or 'all', got {args.policy!r}")
    names = NAMES if args.policy == "all" else [args.policy]
    run = run_sim if args.mode == "sim" else run_real
    results = []
    with contextlib.ExitStack() as stack:
        server = None if args.mode == "sim" and args.index == "memory" else stack.enter_context(RedisServer())  # fmt: skip
        for name in names:
            results.append(run(args, name, server, cost))
            print(json.dumps(results[-1]), flush=True)
    if args.plot:
        Path(args.plot).write_text(routing_svg(results), encoding="utf-8")


if __name__ == "__main__":
    main()
