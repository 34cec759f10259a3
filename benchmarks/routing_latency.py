"""Decision latency of the router over a real `redis-server` (see benchmarks/routing.py).

    python -m benchmarks.routing --latency 4,16,64

`Router.place` (group statuses, the index's one-round-trip match, the policy, the pending
record) is timed at 8k- and 32k-token prompts that extend a cached document; hashing the prompt
is timed apart, and `overhead` is hashing plus decision. `validate` is the router's check of
given token ids (`Router.tokenize`: the vocabulary check), also on the request path.
"""

from __future__ import annotations

import random
import time
import uuid

from cluster.prefix_index import PrefixIndexConfig
from cluster.redis_index import RedisPrefixIndex
from cluster.sim_group import CostModel, SimGroup, SimGroupConfig
from router.policy import PrefixAware, PrefixAwareConfig
from router.router import ModelInfo, Router, RouteRequest
from tests.redis_server import RedisServer
from worker.config import SchedulerConfig
from worker.hashing import BlockHasher, ModelFingerprint
from worker.kv_events import BlockStored

SECRET = b"routing-benchmark-secret"


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def decision_latency(router: Router, doc: list[int], hasher: BlockHasher, n: int = 200) -> dict:
    """place() latency and hashing time at 8k and 32k tokens; prompts extend `doc`, each with
    its own tail (a distinct first token, then a shared random pool)."""
    rng, out = random.Random(1), {}
    pool = rng.choices(range(1000), k=32768)
    for size in (8192, 32768):
        place, hashing, overhead, validate = [], [], [], []
        for i in range(n):
            tokens = (doc + [1000 + i] + pool)[:size]
            tv = time.perf_counter()
            router.tokenize(RouteRequest(prompt_token_ids=tokens))
            t0 = time.perf_counter()
            validate.append(t0 - tv)
            hashes = hasher.hash_prompt(tokens)
            t1 = time.perf_counter()
            router.place(hashes)
            t2 = time.perf_counter()
            place.append(t2 - t1)
            hashing.append(t1 - t0)
            overhead.append(t2 - t0)
        k = f"{size // 1024}k"
        named = ("decision", place), ("hash", hashing), ("overhead", overhead), ("validate", validate)  # fmt: skip
        for name, xs in named:
            out[f"{name}_ms_p50_{k}"] = round(1e3 * pct(xs, 0.5), 3)
            out[f"{name}_ms_p99_{k}"] = round(1e3 * pct(xs, 0.99), 3)
    return out


def run_latency(args, server: RedisServer, n_groups: int, cost: CostModel) -> dict:
    """Decision latency over Redis with `n_groups` groups: each holds `args.blocks` blocks of
    its own documents; group 0 and one other also hold a 16k-token document that every timed
    prompt extends (a hit on two groups, a miss on the rest)."""
    hasher = BlockHasher(SECRET, ModelFingerprint("bench", block_size=args.block_size))
    # Nothing beats here: with the default 3 s TTL the first groups died while the last ones
    # were still publishing (64 groups), and the decision was timed over fewer live groups.
    config = PrefixIndexConfig(heartbeat_ttl_s=600.0)
    index = RedisPrefixIndex.from_url(server.url, f"lat{uuid.uuid4().hex[:8]}", "bench", config)
    sched = SchedulerConfig(max_model_len=1 << 20, max_num_batched_tokens=args.batch_tokens)
    cfg = SimGroupConfig(args.blocks, args.block_size, sched, cost)
    groups = [SimGroup(f"g{i:02d}", cfg, hasher) for i in range(n_groups)]  # statuses only
    rng = random.Random(n_groups)
    doc = rng.choices(range(1000), k=16384)
    doc_hashes = hasher.hash_prompt(doc)
    for i, g in enumerate(groups):
        epoch = index.register_group(g.group_id)
        own = hasher.hash_prompt(rng.choices(range(1000), k=args.blocks * args.block_size))
        held = own[: args.blocks - len(doc_hashes)] + doc_hashes if i in (0, n_groups // 2) else own
        index.publish(g.group_id, epoch, [BlockStored(tuple(held), None)])
        index.report_load(g.group_id, epoch, g.status().load())
    policy = PrefixAware(PrefixAwareConfig(cost=cost))
    policy.block_size = args.block_size
    info = ModelInfo("bench", max_model_len=1 << 20, block_size=args.block_size, kv_cache_dtype="auto", vocab_size=1 << 20)  # fmt: skip
    router = Router(groups, index, hasher, info, policy=policy)
    out = {"latency_groups": n_groups, "index": "redis", "blocks_per_group": args.blocks}
    out.update(decision_latency(router, doc, hasher))
    router.pending.flush()
    index.close()
    return out
