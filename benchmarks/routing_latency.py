"""Decision latency of the router over a real `redis-server` (see benchmarks/routing.py).

    python -m benchmarks.routing --latency 4,16,64

What the router adds to a request is timed at 8k- and 32k-token prompts that extend a cached
document with a new question (see `decision_latency`), over the plain Redis index (one round
trip per match) and over the router's mirror of it (none).
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
import uuid

from cluster.cost_model import CostModel
from cluster.index import (
    InMemoryPrefixIndex,
    MirroredPrefixIndex,
    PrefixIndexConfig,
    RedisPrefixIndex,
)
from cluster.sim_group import SimGroup, SimGroupConfig
from protos.pagefleet.v1 import pagefleet_pb2 as pb
from router.door.api import route_request
from router.launch.run import ROUTER_SWITCH_INTERVAL_S
from router.placement import PrefixAware, PrefixAwareConfig
from router.router import ModelInfo, Router, RouteRequest
from tests.redis_server import RedisServer
from worker.config import SchedulerConfig
from worker.hashing import BlockHasher, ModelFingerprint
from worker.heap import settle_heap
from worker.kv_events import HOST, BlockStored

SECRET = b"routing-benchmark-secret"


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


QUESTION_TOKENS = 256  # each timed prompt: a cached document, then its own new question


ARRIVAL_GAP_S = 0.002  # requests 2 ms apart: 500 a second into one router


def decision_latency(router: Router, doc: list[int], hasher: BlockHasher, n: int = 200) -> dict:
    """What the router adds to a request, at 8k- and 32k-token prompts: a document (`doc`,
    extended with fixed filler to the size) that earlier requests brought, then a new
    256-token question, as `Router.generate` handles them:
      validate    the vocabulary check (`Router.checked_prompt`)
      hash        the chain through the router's hash cache (the document is in it)
      decision    `Router.place`: statuses, the index match, the policy, the pending record
      overhead    hash + decision
      background  CPU time per request of the router's other threads (the pending-placement
                  writer, the mirror's follower), off the request's path
    and hash_uncached: the whole chain by the hasher alone (a document's first request);
    grpc_door: what a gRPC request goes through before its hash: parsing the request message and
    `router.door.api.route_request` (the checks, the prompt as `CheckedIds`, which the router
    trusts: validate's part on this path).
    Requests arrive ARRIVAL_GAP_S apart, so each one's background work is done before the next
    (back to back, it would be timed inside the next request's parts instead)."""
    rng, out = random.Random(1), {}
    filler = rng.choices(range(1000), k=32768)
    for size in (8192, 32768):
        base = (doc + filler)[: size - QUESTION_TOKENS]
        router.hash_cache.hash_prompt(base)  # the document's first request hashed it
        prompts = [base + rng.choices(range(1000), k=QUESTION_TOKENS) for _ in range(n)]
        timed = {k: [] for k in ("validate", "hash", "decision", "overhead", "hash_uncached", "grpc_door")}
        cpu0 = _background_cpu_s()
        for tokens in prompts:
            t0 = time.perf_counter()
            _, checked = router.checked_prompt(RouteRequest(prompt_token_ids=tokens))
            t1 = time.perf_counter()
            hashes = router.hash_cache.hash_prompt(checked)
            t2 = time.perf_counter()
            router.place(hashes)
            t3 = time.perf_counter()
            for k, v in zip(timed, (t1 - t0, t2 - t1, t3 - t2, t3 - t1), strict=False):
                timed[k].append(v)
            time.sleep(ARRIVAL_GAP_S)
        router.ledger.pending.flush()
        background = (_background_cpu_s() - cpu0) / n
        for tokens in prompts[: n // 4]:
            t0 = time.perf_counter()
            hasher.hash_prompt(tokens)
            timed["hash_uncached"].append(time.perf_counter() - t0)
        timed["grpc_door"] = asyncio.run(_door_seconds(router, prompts[: n // 4]))
        k = f"{size // 1024}k"
        for name, xs in timed.items():
            out[f"{name}_ms_p50_{k}"] = round(1e3 * pct(xs, 0.5), 3)
            out[f"{name}_ms_p99_{k}"] = round(1e3 * pct(xs, 0.99), 3)
        out[f"background_ms_{k}"] = round(1e3 * background, 3)
    return out


async def _door_seconds(router: Router, prompts: list[list[int]]) -> list[float]:
    """Per prompt: parsing its GenerateRequest and the door's checks (the router trusts the
    request they make), on one event loop as the server runs them."""
    out = []
    for tokens in prompts:
        wire = pb.GenerateRequest(token_ids=tokens).SerializeToString()
        t0 = time.perf_counter()
        await route_request(pb.GenerateRequest.FromString(wire), router, "bench")
        out.append(time.perf_counter() - t0)
    return out


def _background_cpu_s() -> float:
    """CPU seconds used so far by this process's threads other than the calling (main) one:
    the process's total less this thread's, so a thread that ended meanwhile still counts."""
    return time.process_time() - time.thread_time()


def run_latency(args, server: RedisServer, n_groups: int, cost: CostModel, index_kind: str = "mirror") -> dict:
    """Decision latency over Redis with `n_groups` groups: each holds `args.blocks` blocks of
    its own documents; group 0 and one other also hold the document that every timed prompt
    extends (a hit on two groups, a miss on the rest). With `args.host_capacity` X, each group
    also has a host tier of X * blocks of other documents, and two more groups hold the timed
    document there (a hit below the device, counted through the tiers). `index_kind`: "redis" (one round trip
    per match), "mirror" (the router's local copy, cluster/index/mirror.py) or "memory" (the
    in-process index of `pagefleet serve` without --redis; Redis unused)."""
    hasher = BlockHasher(SECRET, ModelFingerprint("bench", block_size=args.block_size))
    # Nothing beats here: with the default 3 s TTL the first groups died while the last ones
    # were still publishing (64 groups), and the decision was timed over fewer live groups.
    config = PrefixIndexConfig(heartbeat_ttl_s=600.0)
    ns = f"lat{uuid.uuid4().hex[:8]}"
    if index_kind == "memory":
        index = InMemoryPrefixIndex(config)
    else:
        index = RedisPrefixIndex.from_url(server.url, ns, "bench", config)
    sched = SchedulerConfig(max_model_len=1 << 20, max_num_batched_tokens=args.batch_tokens)
    cfg = SimGroupConfig(args.blocks, args.block_size, sched, cost)
    groups = [SimGroup(f"g{i:02d}", cfg, hasher) for i in range(n_groups)]  # statuses only
    rng = random.Random(n_groups)
    doc = rng.choices(range(1000), k=32768 - QUESTION_TOKENS)
    doc_hashes = hasher.hash_prompt(doc)
    host_blocks = round(getattr(args, "host_capacity", 0.0) * args.blocks)
    if host_blocks:
        host_blocks = max(host_blocks, len(doc_hashes))
    for i, g in enumerate(groups):
        epoch = index.register_group(g.group_id)
        own = hasher.hash_prompt(rng.choices(range(1000), k=args.blocks * args.block_size))
        held = own[: args.blocks - len(doc_hashes)] + doc_hashes if i in (0, n_groups // 2) else own
        index.publish(g.group_id, epoch, [BlockStored(tuple(held), None)])
        if host_blocks:
            below = hasher.hash_prompt(rng.choices(range(1000), k=host_blocks * args.block_size))
            if i in (1, n_groups // 2 + 1):
                below = below[: host_blocks - len(doc_hashes)] + doc_hashes
            index.publish(g.group_id, epoch, [BlockStored(tuple(below), None, HOST)])
    policy = PrefixAware(PrefixAwareConfig(cost=cost), args.block_size, args.batch_tokens)
    info = ModelInfo(
        "bench", max_model_len=1 << 20, block_size=args.block_size, kv_cache_dtype="auto", vocab_size=1 << 20
    )
    sys.setswitchinterval(ROUTER_SWITCH_INTERVAL_S)  # as `pagefleet serve` runs the router
    if index_kind == "mirror":  # the router's own client, as `pagefleet serve` builds it
        routed = MirroredPrefixIndex(RedisPrefixIndex.from_url(server.url, ns, "bench", config))
        if not routed.wait_synced(30.0):
            raise RuntimeError("the index mirror did not catch up")
    else:
        routed = index
    router = Router(groups, routed, hasher, info, policy=policy)
    settle_heap()  # as `pagefleet serve` does once its cluster is up
    out = {"latency_groups": n_groups, "index": index_kind, "blocks_per_group": args.blocks}
    if host_blocks:
        out["host_blocks_per_group"] = host_blocks
    out.update(decision_latency(router, doc, hasher))
    router.ledger.pending.flush()
    routed.close()
    index.close()
    return out
