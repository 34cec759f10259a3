"""Routing benchmark: hit rate, load balance, TTFT and decision latency per placement policy.

    python -m benchmarks.routing --trace T.jsonl --groups 16 --policy all --mode sim --plot r.svg
    python -m benchmarks.routing --trace T.jsonl --groups 4 --capacity 1.25 --rates 25,100 --plot s.svg
    python -m benchmarks.routing --trace T.jsonl --groups 2 --policy all --mode real
    python -m benchmarks.routing --latency 4,16,64
    python -m benchmarks.routing --calibrate --cost-out cost.json   # [--no-ray]

Every policy replays the same trace against fresh groups and prints one JSON line; `all` runs the
router's policies and the references of benchmarks/oracles.py: `oracle_balanced`, the
clairvoyant placement under the load bound, and `cache_aware_threshold`, the cache-aware rule of
SGLang's router. A line gives the hit rate (and the predicted one), requests and computed tokens
per group, TTFT, the decision's time, and per document the groups its requests went to
(`workers_per_doc`; `replicas`, the copies beyond one), with `spills`, requests placed where
another group held more of the prompt. `--rates R,...` replays the trace at each arrival rate
(its arrival times scaled), a line per rate and policy with the groups' `utilisation` and the
`offered_load` (their busy time over the arrivals' span), and a warning where that passes 1;
`--plot` then draws hit rate, TTFT p99 and the KV blocks pulled against the rate. In sim mode the
router's own policies pull a prefix another group holds when the cost model says the pull is
sooner than recomputing it, and wait for a cold one another group is computing, as the router
does (router/router.py: `pull_source`, `cold_source`); the pulled blocks land in the puller's
host tier (`--host-capacity`; without one a pull brings nothing) and count as hits. The
references recompute what their group lacks; `--no-pulls` makes every policy do so. A line
gives `pull_placements` (placements naming a pull), `pulls` (those that brought blocks),
`blocks_pulled` and `pull_failures`. `--capacity X` sizes the groups'
pools to X times the blocks of the trace's documents. `--mode sim`
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
import math
import random
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

from tqdm import tqdm

from benchmarks.oracles import BalancedOracle, CacheAwareThreshold, Oracle, with_documents
from benchmarks.plot import routing_svg, sweep_svg
from benchmarks.routing_latency import SECRET, decision_latency, pct, run_latency
from benchmarks.traces import TraceRequest, read
from cluster.cost_model import CostModel
from cluster.index import InMemoryPrefixIndex, MirroredPrefixIndex, RedisPrefixIndex
from cluster.local_group import LocalGroup
from cluster.sim_group import Arrival, Placed, PullRules, SimClock, SimGroup, SimGroupConfig, Simulation
from router.placement import POLICIES, Placement, PrefixAware, PrefixAwareConfig, make_policy
from router.router import COLD_POLL_S, PULL_TIMEOUT_S, ModelInfo, Router, RouteRequest, _ColdPull, pull_pays
from tests.redis_server import RedisServer
from worker.config import SchedulerConfig
from worker.hashing import BlockHasher, ModelFingerprint
from worker.sampling_params import SamplingParams

# the router's policies, then the benchmark's references: the clairvoyant peer under the load
# bound and the field's cache-aware threshold rule
NAMES = [*sorted([*POLICIES, Oracle.name]), BalancedOracle.name, CacheAwareThreshold.name]
Requests = Callable[[], Iterator[TraceRequest]]  # the trace's requests, from the start each call


def trace_requests(path: str, block_size: int, rate: float | None = None) -> Requests:
    """The trace's requests, with documents derived where it names none (benchmarks/oracles.py)
    and, given `rate`, arrival times scaled so that requests / last arrival is `rate` per
    second: the same trace, replayed faster or slower."""
    scale = 1.0
    if rate is not None:
        times = [r.arrival_s for r in read(path)]
        if not rate > 0 or not times or not times[-1] > 0:
            raise ValueError(f"rates must be > 0 on a trace whose arrivals span time, got {rate}")
        scale = len(times) / times[-1] / rate

    def requests() -> Iterator[TraceRequest]:
        for r in with_documents(lambda: read(path), block_size):
            yield r if scale == 1.0 else replace(r, arrival_s=r.arrival_s * scale)

    return requests


def document_blocks(requests: Requests, block_size: int) -> int:
    """The blocks the trace's documents take (each document once per tenant)."""
    docs = {(r.doc, r.tenant): r.doc_tokens for r in requests() if r.doc is not None}
    return sum(-(-tokens // block_size) for tokens in docs.values())


def spread(counts: Counter, groups: list[str]) -> dict:
    values = [counts.get(g, 0) for g in groups]
    mean = sum(values) / len(values)
    return {"per_group": values, "max_over_mean": round(max(values) / mean, 3) if mean else None}


def make_router(
    groups,
    index,
    hasher,
    block_size: int,
    policy_name: str,
    cost: CostModel,
    tuning: dict | None = None,
    requests: Requests | None = None,
    batch_tokens: int = 2048,
):
    if policy_name == "prefix_aware":
        policy = PrefixAware(PrefixAwareConfig(cost=cost, **(tuning or {})), block_size, batch_tokens)
    elif policy_name == BalancedOracle.name:  # plans over the whole trace first
        policy = BalancedOracle.plan(requests(), [g.group_id for g in groups], block_size=block_size)
    elif policy_name == CacheAwareThreshold.name:
        policy = CacheAwareThreshold(block_size)
    elif policy_name == Oracle.name:
        policy = Oracle(block_size)
    else:
        policy = make_policy(policy_name, block_size, batch_tokens)
    info = ModelInfo("bench", max_model_len=1 << 20, block_size=block_size, kv_cache_dtype="auto", vocab_size=1 << 20)
    return Router(groups, index, hasher, info, policy=policy)


class Row(NamedTuple):
    """One request's outcome: where it went, its tokens predicted and found cached, its TTFT,
    its document (if any) and whether it was a spill (placed where another group held more of
    its prompt)."""

    group: str
    prompt_tokens: int
    predicted: int
    actual: int
    ttft_s: float | None
    doc: str | None = None
    spill: bool = False


def summarize(name, rows: list[Row], groups, decisions, extra) -> dict:
    prompt = sum(r.prompt_tokens for r in rows)
    actual = sum(r.actual for r in rows)
    agree = sum(1 for r in rows if r.predicted == r.actual)
    ttfts = [r.ttft_s for r in rows if r.ttft_s is not None]
    workers = Counter(d for d, _ in {(r.doc, r.group) for r in rows if r.doc is not None})
    return {
        "policy": name,
        "requests": len(rows),
        "hit_rate": round(actual / prompt, 4) if prompt else None,
        "predicted_hit_rate": round(sum(r.predicted for r in rows) / prompt, 4) if prompt else None,
        "predicted_equals_actual": round(agree / len(rows), 4) if rows else None,
        "prompt_tokens": prompt,
        "computed_tokens": prompt - actual,
        "requests_per_group": spread(Counter(r.group for r in rows), groups),
        "prefill_tokens_per_group": spread(Counter({g: v for g, v in extra.pop("prefill").items()}), groups),
        "ttft_s_p50": round(pct(ttfts, 0.5), 4) if ttfts else None,
        "ttft_s_p99": round(pct(ttfts, 0.99), 4) if ttfts else None,
        "decision_ms_p50_trace": round(1e3 * pct(decisions, 0.5), 3),
        "decision_ms_p99_trace": round(1e3 * pct(decisions, 0.99), 3),
        "spills": sum(r.spill for r in rows),
        "docs": len(workers),
        "workers_per_doc": round(sum(workers.values()) / len(workers), 3) if workers else None,
        "workers_per_doc_max": max(workers.values(), default=None),
        "replicas": sum(workers.values()) - len(workers),
        **extra,
    }


# ---- simulated groups ----------------------------------------------------------------------
def run_sim(args, policy_name: str, server: RedisServer | None, cost: CostModel, rate: float | None = None) -> dict:
    """One policy over the trace (replayed at `rate` requests per second, if given)."""
    hasher = BlockHasher(SECRET, ModelFingerprint("bench", block_size=args.block_size))
    requests = trace_requests(args.trace, args.block_size, rate)
    clock = SimClock() if server is None else None
    if clock is not None:  # liveness and pending TTLs in simulated seconds
        index = InMemoryPrefixIndex(clock=clock)
    else:
        index = RedisPrefixIndex.from_url(server.url, f"sim{uuid.uuid4().hex[:8]}", "bench")
    sched = SchedulerConfig(max_model_len=1 << 20, max_num_batched_tokens=args.batch_tokens)
    host, disk = round(args.host_capacity * args.blocks), round(args.disk_capacity * args.blocks)
    cfg = SimGroupConfig(args.blocks, args.block_size, sched, cost, host_blocks=host, disk_blocks=disk)
    groups = [SimGroup(f"g{i:02d}", cfg, hasher, index, clock or time.monotonic) for i in range(args.groups)]
    router = make_router(
        groups, index, hasher, args.block_size, policy_name, cost, args.tuning, requests, args.batch_tokens
    )
    placed, decisions, last_doc = {}, [], [[]]  # placed: request id -> (predicted, doc, spill)
    doc_hashes: dict[tuple, list[bytes]] = {}
    span = [0.0]  # the last arrival

    def arrivals():
        for r in tqdm(requests(), desc=policy_name, unit="req", leave=False, disable=None):
            hashes = None
            if r.doc is not None:  # the document's blocks are hashed once per tenant
                key = (r.doc, r.tenant)
                if key not in doc_hashes:
                    doc_hashes[key] = hasher.hash_prompt(r.prompt_token_ids[: r.doc_tokens], cache_salt=r.tenant)
                head = doc_hashes[key]
                parent = head[-1] if head else hasher.root(None, r.tenant)
                hashes = head + hasher.hash_blocks(r.prompt_token_ids, parent, len(head))
                last_doc[0] = r.prompt_token_ids[: r.doc_tokens]
            span[0] = r.arrival_s
            yield Arrival(r.id, r.arrival_s, r.prompt_token_ids, r.max_tokens, r.tenant, r.doc, hashes)

    # The router's own policies pull as the router does (Router.place: `pull_source`, a cold
    # prefix's `cold_source`, a shared cold pull joined); the references recompute what their
    # group lacks, as their systems do. --no-pulls: every policy recomputes.
    pulls = not args.no_pulls and policy_name in POLICIES
    asked = [0]  # placements that named a pull (some find the blocks already there)
    if not pulls:
        router.cold_wait_s = 0.0

    def sent(a: Arrival, p: Placement, spill: bool) -> None:
        """The request goes to its group: what it predicts cached, in flight (Router.stream)."""
        hits = p.cached_tokens(len(a.prompt), args.block_size)
        placed[a.request_id] = (hits, a.key, spill)
        router.ledger.add_in_flight(p.group_id, len(a.prompt) - hits, hits)

    def place(a: Arrival, hashes: list[bytes]) -> SimGroup | Placed:
        best = max((m.expected_blocks for m in router.ledger.matches(hashes).values()), default=0)
        if isinstance(router.policy, Oracle):
            router.policy.expect(a.key, len(a.prompt))
        t0 = time.perf_counter()
        p = router.place(hashes)
        decisions.append(time.perf_counter() - t0)
        spill = p.cached_blocks < min(best, (len(a.prompt) - 1) // args.block_size)
        group = router.groups[p.group_id]
        if not pulls or p.pull_from is None:
            sent(a, replace(p, pull_from=None, pull_blocks=0, pull_wait=False), spill)
            return group
        chain = hashes[: p.pull_blocks]
        asked[0] += 1
        key = (p.group_id, chain[-1])
        if p.pull_wait and key not in router._cold:  # later requests join it (Router.joined_pull)
            router._cold[key] = _ColdPull(p.pull_from, len(chain), None)

        def pulled(blocks: int) -> None:  # as Router._pull answers, just before the request goes
            router._cold.pop(key, None)
            if blocks:
                sent(a, replace(p, cached_blocks=max(p.cached_blocks, p.pull_blocks)), spill)
            else:
                sent(a, replace(p, pull_from=None, pull_blocks=0, pull_wait=False), spill)

        return Placed(group, router.groups[p.pull_from], chain, p.pull_wait, pulled)

    def first_token(rec) -> None:
        hits = placed[rec.request_id][0]
        router.ledger.add_in_flight(rec.group_id, hits - rec.prompt_tokens, -hits)

    rules = PullRules(
        PULL_TIMEOUT_S,
        router.cold_wait_s,
        COLD_POLL_S,
        lambda blocks: pull_pays(blocks, cost, args.block_size, cfg.same_node),
    )
    wall = time.perf_counter()
    done = Simulation(groups, hasher, clock=clock, pulls=rules).run(arrivals(), place, first_token)
    wall = time.perf_counter() - wall
    rows = [
        Row(d.group_id, d.prompt_tokens, placed[d.request_id][0], d.cached_tokens, d.ttft_s, *placed[d.request_id][1:])
        for d in done
    ]
    extra = {
        "prefill": {g.group_id: g.prefill_tokens for g in groups},
        "mode": "sim",
        "index": args.index,
        "groups": args.groups,
        "blocks": args.blocks,
        # KV pulled between groups instead of recomputed: pulls that brought blocks, the
        # blocks, and pulls that brought none (no host tier, timed out, nothing committed)
        "kv_pulls": pulls,
        "pull_placements": asked[0],
        "pulls": sum(g.pulls for g in groups),
        "blocks_pulled": sum(g.pulled_blocks for g in groups),
        "pull_failures": sum(g.pull_failures for g in groups),
    }
    if host:  # the KV tiers under each pool: blocks, and prompt tokens restored from them
        extra.update(host_blocks=host, disk_blocks=disk, load_block_s=cost.load_block_s)
        extra["restored_tokens"] = sum(g.scheduler.bm.host_hits for g in groups)
        extra["from_disk_tokens"] = sum(g.scheduler.bm.disk_hits for g in groups)
    extra.update(load(groups, span[0], max((d.finished_s for d in done), default=0.0), rate))
    extra["wall_s"] = round(wall, 1)
    if server is not None:
        extra.update(decision_latency(router, last_doc[0], hasher, n=40))
    router.ledger.pending.flush()
    for g in groups:
        g.shutdown()
    index.close()
    if policy_name == "prefix_aware" and args.tuning:
        extra["tuning"] = args.tuning
    return summarize(policy_name, rows, [g.group_id for g in groups], decisions, extra)


def load(groups: list[SimGroup], last_arrival: float, last_finish: float, rate: float | None) -> dict:
    """How busy the groups were: `utilisation`, their steps' seconds over the run's (first
    arrival to last finish, all groups); `offered_load`, the same seconds over the arrivals'
    span: above 1 the trace brought more work than the groups could do while it arrived
    (queues grew to its end), and a warning says so."""
    busy = sum(g.busy_s for g in groups)
    out = {"rate": rate, "utilisation": round(busy / (len(groups) * last_finish), 3) if last_finish > 0 else None}
    out["offered_load"] = round(busy / (len(groups) * last_arrival), 3) if last_arrival > 0 else None
    if out["offered_load"] is not None and out["offered_load"] > 1:
        out["warning"] = "offered load exceeds the groups' capacity: queues grew through the trace"
    return out


# ---- real groups on this CPU ------------------------------------------------------------------
def run_real(args, policy_name: str, server: RedisServer, cost: CostModel) -> dict:
    from pagefleet.llm import engine_config

    ns = f"real{uuid.uuid4().hex[:8]}"
    index = RedisPrefixIndex.from_url(server.url, ns, "bench")  # the groups'
    routed = MirroredPrefixIndex(RedisPrefixIndex.from_url(server.url, ns, "bench"))  # the router's
    config = engine_config(
        "builtin",
        num_blocks=args.blocks,
        block_size=args.block_size,
        cluster_secret=SECRET,
        max_num_batched_tokens=args.batch_tokens,
        max_model_len=min(4096, args.blocks * args.block_size),
    )
    groups = [LocalGroup(config, index, group_id=f"g{i}") for i in range(args.groups)]
    hasher = groups[0].hasher
    requests = trace_requests(args.trace, args.block_size)
    router = make_router(
        groups, routed, hasher, args.block_size, policy_name, cost, requests=requests, batch_tokens=args.batch_tokens
    )
    reqs = list(requests())
    rows: list = []
    decisions: list[float] = []

    async def one(r: TraceRequest, t0: float) -> None:
        await asyncio.sleep(max(0.0, t0 + r.arrival_s * args.time_scale - time.perf_counter()))
        if isinstance(router.policy, Oracle):
            router.policy.expect(r.doc, len(r.prompt_token_ids))
        start = time.perf_counter()
        req = RouteRequest(
            prompt_token_ids=r.prompt_token_ids,
            params=SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True),
            request_id=r.id,
            cache_salt=r.tenant,
        )
        ttft = None
        async for _out in router.generate(req):
            ttft = ttft if ttft is not None else time.perf_counter() - start
        rec = router.records[r.id]
        decisions.append(rec.decision_seconds)
        rows.append(
            Row(
                rec.group_id,
                len(r.prompt_token_ids),
                rec.predicted_cached_tokens,
                rec.actual_cached_tokens,
                ttft,
                r.doc,
            )
        )

    async def replay() -> None:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(r, t0) for r in reqs))

    asyncio.run(replay())
    prefill = {g.group_id: g.status().prefix_cache_queries - g.status().prefix_cache_hits for g in groups}
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
def calibrate(block_size: int = 16, across_nodes: bool = True) -> CostModel:
    """Fit the cost model to steps of the real engine (built-in model, this CPU), time a
    restore from its host tier (`load_block_s`) and pulls between two groups (`pull_link`):
    within a node (two groups in one process) and, unless `across_nodes` is False (then the
    stated default stays), across two Ray nodes on loopback."""
    from pagefleet.llm import engine_config
    from worker.engine.llm_engine import LLMEngine

    engine = LLMEngine(engine_config("builtin", num_blocks=1024, block_size=block_size, enable_prefix_caching=False))
    rng, samples = random.Random(0), []
    for prefill, decodes in [(0, 1), (0, 8), (0, 32), (256, 0), (1024, 0), (2048, 0), (512, 16)]:
        for _ in range(3):
            for _ in range(decodes):  # decoding sequences: admitted, prefilled, one token out
                engine.add_request(
                    [rng.randrange(1000) for _ in range(8)],
                    SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True),
                )
            while engine.scheduler.waiting or any(
                r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running
            ):
                engine.step()
            if prefill:
                engine.add_request(
                    [rng.randrange(1000) for _ in range(prefill)], SamplingParams(max_tokens=1, temperature=0.0)
                )
            t0 = time.perf_counter()
            engine.step()
            samples.append((prefill, decodes, time.perf_counter() - t0))
            engine.abort([r.request_id for r in list(engine.scheduler.requests.values())])
    engine.shutdown()
    latency, bandwidth, block_bytes = pull_link(block_size)
    cost = replace(
        CostModel.fit(samples),
        load_block_s=load_block_seconds(block_size),
        pull_latency_s=latency,
        pull_bandwidth=bandwidth,
        block_bytes=block_bytes,
    )
    if across_nodes:
        latency, bandwidth, _ = pull_link(block_size, transport="ray")
        cost = replace(cost, remote_pull_latency_s=latency, remote_pull_bandwidth=bandwidth)
    return cost


def pull_link(
    block_size: int = 16, sizes: tuple[int, ...] = (4, 16, 64), repeats: int = 3, transport: str = "in_process"
) -> tuple[float, float, int]:
    """(latency s, bandwidth bytes/s, bytes a block) of a pull between two groups, fitted to
    timed pulls of several sizes (`link_samples`, `CostModel.fit_link`), over `transport`
    (benchmarks/kv_pull.py's `Groups`): `in_process`, two LocalGroups, the link within a node
    (the holder's engine exports the blocks between its steps, the puller's imports them into
    its host tier); `ray`, a two-node Ray cluster on loopback with one group per node, each
    rank's shard crossing the object store from one node's store to the other's, the link
    across nodes (less the network a real cluster adds)."""
    from benchmarks.kv_pull import Groups
    from pagefleet.llm import engine_config
    from router.launch.local import router_side

    most = max(sizes)
    config = engine_config(
        "builtin",
        num_blocks=4 * most + 8,
        block_size=block_size,
        max_model_len=(most + 4) * block_size,
        kv_host_bytes=1 << 26,
        cluster_secret="routing-calibration",
    )
    hasher = router_side(config, "builtin")[0]
    groups = Groups(transport, config)
    try:
        stats = groups.stats(groups.g0)
        block_bytes = int(stats["block_size"] * stats["kv_bytes_per_token"])
        samples = link_samples(groups.g0, groups.g1, hasher, block_bytes, sizes, repeats)
    finally:
        groups.close()
    latency, bandwidth = CostModel.fit_link(samples)
    return latency, bandwidth, block_bytes


def link_samples(
    holder, puller, hasher, block_bytes: int, sizes: tuple[int, ...], repeats: int, seed: int = 1
) -> list[tuple[int, float]]:
    """(bytes, seconds) of `repeats` timed pulls of each size in `sizes` blocks of
    `block_bytes` (all layers' K and V): the holder
    computes a fresh prompt of that many full blocks, then the puller pulls them
    (`GroupHandle.pull_from`); a first round warms up and is not kept. A pull that brings
    fewer blocks than asked raises: the link was not measured."""
    from worker.protocol import GenerationRequest

    rng, samples = random.Random(seed), []
    params = SamplingParams(max_tokens=1, temperature=0.0)
    block_size = hasher.block_size

    async def one(blocks: int, tag: str) -> float:
        ids = [rng.randrange(3, 1000) for _ in range(blocks * block_size + 1)]
        hashes = hasher.hash_prompt(ids)
        request = GenerationRequest(ids, params, request_id=tag, block_hashes=hashes)
        [_ async for _ in holder.generate(request)]
        t0 = time.perf_counter()
        got = await puller.pull_from(holder, hashes[:blocks], timeout_s=30.0)
        if got != blocks:
            raise RuntimeError(f"calibration pull brought {got} of {blocks} blocks")
        return time.perf_counter() - t0

    for r in range(repeats + 1):  # the first round warms up
        for blocks in sizes:
            seconds = asyncio.run(one(blocks, f"pull-{seed}-{r}-{blocks}"))
            if r:
                samples.append((blocks * block_bytes, seconds))
    return samples


def load_block_seconds(block_size: int = 16, blocks: int = 128) -> float:
    """Seconds to restore one block from the host tier into the pool: the median of timed
    copies of `blocks` blocks (the copy a step with loads makes, worker/exec/host_tier.py)."""
    from benchmarks.kv_tiers import restore_copy

    seconds, _ = restore_copy("builtin", 2 * blocks, blocks, (1 << 28) // blocks, block_size=block_size)
    return seconds / blocks


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--trace")
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--policy", default="all", help=f"of {NAMES}: one, several (a,b) or 'all'")
    p.add_argument("--mode", choices=("sim", "real"), default="sim")
    p.add_argument("--blocks", type=int, default=2048, help="KV blocks per group")
    p.add_argument(
        "--capacity", type=float, help="instead of --blocks: all groups' blocks over the trace's documents' (e.g. 1.25)"
    )
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--batch-tokens", type=int, default=2048)
    p.add_argument("--host-capacity", type=float, default=0.0, help="sim: a host KV tier of X times each pool")
    p.add_argument("--disk-capacity", type=float, default=0.0, help="sim: a disk KV tier of X times each pool")
    p.add_argument("--load-block-s", type=float, help="sim: seconds to restore a block from the host tier")
    p.add_argument("--fetch-block-s", type=float, help="sim: seconds to read a block from the disk tier")
    p.add_argument("--time-scale", type=float, default=1.0, help="real mode: wall s per trace s")
    p.add_argument("--cost", help="cost model JSON (from --calibrate); default: built in")
    p.add_argument("--index", choices=("memory", "redis"), default="memory", help="sim mode's index")
    p.add_argument("--tuning", type=json.loads, default={}, help="PrefixAwareConfig fields, JSON")
    p.add_argument("--latency", help="comma-separated group counts: decision latency over Redis")
    p.add_argument("--calibrate", action="store_true")
    p.add_argument("--no-ray", action="store_true", help="calibrate: skip the link across Ray nodes")
    p.add_argument("--cost-out")
    p.add_argument("--plot", help="also write the policies' results as an SVG (benchmarks/plot.py)")
    p.add_argument("--rates", help="sim mode: comma-separated requests/s to replay the trace at")
    p.add_argument("--no-pulls", action="store_true", help="sim: the router's policies recompute instead of pulling KV")
    args = p.parse_args(argv)
    if args.calibrate:
        cost = calibrate(args.block_size, across_nodes=not args.no_ray)
        print(json.dumps({"cost_model": cost.__dict__}))
        if args.cost_out:
            with open(args.cost_out, "w") as f:
                json.dump(cost.__dict__, f)
        return
    cost = CostModel(**json.loads(Path(args.cost).read_text())) if args.cost else CostModel()
    tiers = {"load_block_s": args.load_block_s, "fetch_block_s": args.fetch_block_s}
    cost = replace(cost, **{k: v for k, v in tiers.items() if v is not None})
    if args.latency:
        with RedisServer() as server:
            for n in (int(x) for x in args.latency.split(",")):
                for kind in ("redis", "mirror", "memory"):
                    print(json.dumps(run_latency(args, server, n, cost, kind)), flush=True)
        return
    if not args.trace:
        p.error("--trace is required (generate one with python -m benchmarks.traces)")
    names = NAMES if args.policy == "all" else args.policy.split(",")
    if not set(names) <= set(NAMES):
        p.error(f"--policy must be of {NAMES} (one, several or 'all'), got {args.policy!r}")
    if args.capacity is not None:
        if not args.capacity > 0:
            p.error(f"--capacity must be > 0, got {args.capacity}")
        docs = document_blocks(trace_requests(args.trace, args.block_size), args.block_size)
        args.blocks = max(1, math.ceil(args.capacity * docs / args.groups))
    try:
        rates = [None] if not args.rates else [float(x) for x in args.rates.split(",")]
    except ValueError:
        p.error(f"--rates must be comma-separated numbers, got {args.rates!r}")
    if not all(r is None or r > 0 for r in rates):
        p.error(f"--rates must be > 0, got {args.rates!r}")
    if args.rates and args.mode != "sim":
        p.error("--rates replays the trace in simulated time: use --mode sim")
    results = replay(args, names, rates, cost)
    if args.plot:
        svg = sweep_svg(results) if args.rates else routing_svg(results)
        Path(args.plot).write_text(svg, encoding="utf-8")


def replay(args, names: list[str], rates: list[float | None], cost: CostModel) -> list[dict]:
    """Every policy at every rate (None: the trace's own), printing each line as it comes."""
    results = []
    with contextlib.ExitStack() as stack:
        server = None if args.mode == "sim" and args.index == "memory" else stack.enter_context(RedisServer())
        for rate in rates:
            for name in names:
                if args.mode == "sim":
                    results.append(run_sim(args, name, server, cost, rate))
                else:
                    results.append(run_real(args, name, server, cost))
                print(json.dumps(results[-1]), flush=True)
                if "warning" in results[-1]:
                    at = f"{rate:g}/s" if rate else "the trace's rate"
                    print(f"warning: {name} at {at}: {results[-1]['warning']}", file=sys.stderr)
    return results


if __name__ == "__main__":
    main()
