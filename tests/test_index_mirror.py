"""The router's local copy of the Redis prefix index (cluster/index/mirror.py) against a real
redis-server: it answers what Redis' own match answers, without a round trip, and heals itself
after a trimmed log and a Redis restart. (tests/test_prefix_index.py runs its shared tests on the
mirror too.)"""

from __future__ import annotations

import gc
import math
import random
import uuid

import pytest
import redis
from factories import wait_until

from cluster.index import (
    IndexPublisher,
    IndexUnavailableError,
    MirroredPrefixIndex,
    PendingWrite,
    PrefixIndexConfig,
    PublisherConfig,
    RedisPrefixIndex,
)
from cluster.index.copy import IndexCopy
from cluster.index.probes import probe_hashes
from tests.redis_server import RedisServer
from worker.hashing import BlockHasher, ModelFingerprint
from worker.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

HASHER = BlockHasher(b"mirror-test-secret", ModelFingerprint("tiny", block_size=2))


def chain(n: int, doc: int) -> list[bytes]:
    return HASHER.hash_prompt([doc] + list(range(2 * n - 1)))


@pytest.fixture
def pair(redis_server):
    """(writer, mirror): the groups' and routers' client and a router's mirror, one namespace."""
    ns = f"m{uuid.uuid4().hex[:8]}"
    writer = RedisPrefixIndex.from_url(redis_server.url, ns, "m")
    mirror = MirroredPrefixIndex(RedisPrefixIndex.from_url(redis_server.url, ns, "m"))
    yield writer, mirror
    mirror.close()
    writer.close()


def same_answer(writer: RedisPrefixIndex, mirror: MirroredPrefixIndex, chains) -> None:
    assert mirror.wait_synced()
    for c in chains:
        got, want = mirror.match(c), writer.match(c)
        assert got == want
        for m in (got, want):  # a policy reads only the answers said to be touched
            assert {g for g, a in m.items() if a.expected_blocks} <= set(m.touched) <= set(m)


@pytest.mark.parametrize("groups, steps, longest", [(4, 60, 120), (70, 600, 400)])
def test_mirror_answers_what_redis_answers_through_random_histories(pair, groups, steps, longest):
    """Also past 64 registrations (the copy's masks are wider than a machine word) and with
    chains long enough for gaps between sparse probes."""
    writer, mirror = pair
    rng = random.Random(groups)
    docs = {d: chain(rng.randint(1, longest), d) for d in range(6)}
    epochs = {g: writer.register_group(g) for g in (f"g{i}" for i in range(groups))}
    held = {g: set() for g in epochs}
    for step in range(steps):
        g = rng.choice(sorted(epochs))
        c = docs[rng.randrange(len(docs))]
        op = rng.random()
        if op < 0.45:  # a prefix stored, as an engine stores it
            n = rng.randint(1, len(c))
            writer.publish(g, epochs[g], [BlockStored(tuple(c[:n]), None)])
            held[g].update(c[:n])
        elif op < 0.65:  # a tail evicted
            n = rng.randint(0, len(c) - 1)
            writer.publish(g, epochs[g], [BlockRemoved(tuple(c[n:]))])
        elif op < 0.7:
            writer.publish(g, epochs[g], [AllBlocksCleared()])
        elif op < 0.8:
            writer.heartbeat(g, epochs[g])
        elif op < 0.95:  # pending placements, some keeping their fresh probes
            n = rng.randint(1, len(c))
            writer.record_pending_many([PendingWrite(g, c[:n], rng.choice([0, 0, 5, 40]))])
        else:  # a group restarts: its old entries never match again
            epochs[g] = writer.register_group(g)
        if step % 10 == 9:
            queries = [c[: rng.randint(1, len(c))] for c in docs.values()] + [[], docs[0][:1]]
            same_answer(writer, mirror, queries)
    writer.deregister("g3", epochs["g3"])
    same_answer(writer, mirror, list(docs.values()))
    assert "g3" not in mirror.match(docs[0])


def test_a_match_on_the_mirror_sends_nothing_to_redis(pair, redis_server):
    writer, mirror = pair
    c = chain(100, 1)
    for i in range(4):
        writer.publish(f"g{i}", writer.register_group(f"g{i}"), [BlockStored(tuple(c[: 25 * i]), None)])
    assert mirror.wait_synced()
    admin = redis.Redis.from_url(redis_server.url)

    def calls() -> dict[str, int]:
        return {k: s["calls"] for k, s in admin.info("commandstats").items()}

    before = calls()
    answers = [mirror.match(c) for _ in range(20)]
    after = calls()
    sent = {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}
    sent.pop("cmdstat_info", None)  # ours
    sent.pop("cmdstat_xread", None)  # the follower's blocking read of the log, every 0.1 s
    assert sent == {}
    assert {g: m.blocks for g, m in answers[-1].items()} == {"g0": 0, "g1": 25, "g2": 50, "g3": 75}


def test_own_placements_are_seen_at_once_and_other_mirrors_catch_up(pair, redis_server):
    writer, mirror = pair
    other = MirroredPrefixIndex(RedisPrefixIndex.from_url(redis_server.url, writer.prefix.split(":")[1], "m"))
    try:
        c = chain(80, 2)
        writer.register_group("g0")
        assert mirror.wait_synced()
        mirror.record_pending("g0", c)  # no wait: applied locally once Redis took it
        assert mirror.match(c)["g0"].pending_blocks == 80
        assert other.wait_synced()
        assert other.match(c)["g0"].pending_blocks == 80
    finally:
        other.close()


def test_a_gap_in_the_log_reloads_the_snapshot(pair):
    writer, mirror = pair
    c = chain(40, 3)
    epoch = writer.register_group("g0")
    writer.publish("g0", epoch, [BlockStored(tuple(c[:10]), None)])
    assert mirror.wait_synced()
    writer.client.incrby(writer.prefix + "logseq", 7)  # entries lost, as when the log is trimmed
    writer.publish("g0", epoch, [BlockStored(tuple(c[10:30]), None)])
    same_answer(writer, mirror, [c])
    assert mirror.match(c)["g0"].blocks == 30
    assert mirror.snapshots >= 2


def test_mirror_falls_back_to_redis_and_heals_after_a_restart():
    c = chain(30, 4)
    cache: set[bytes] = set()
    with RedisServer() as server:
        group_side = RedisPrefixIndex.from_url(server.url, "restart", "m", socket_timeout_s=0.3)
        pub = IndexPublisher(
            group_side, "g0", lambda: set(cache), PublisherConfig(retry_initial_s=0.05, retry_max_s=0.2)
        )
        shared = RedisPrefixIndex.from_url(server.url, "restart", "m", socket_timeout_s=0.3)
        mirror = MirroredPrefixIndex(shared, read_block_s=0.05, retry_s=0.05)
        try:
            cache.update(c[:12])
            pub.sink(BlockStored(tuple(c[:12]), None))
            pub.tick()
            assert mirror.wait_synced() and mirror.match(c)["g0"].blocks == 12
            health = mirror.health()  # what the router's metrics tell
            assert health.shared and health.reachable and health.mirror_lag_s < 1.0
            assert (health.entries, health.blocks, health.groups) == (12, 12, 1)
            first_epoch = pub.epoch
            server.stop()
            assert wait_until(lambda: not mirror.synced, 3.0)
            assert wait_until(lambda: not mirror.health().reachable, 3.0)
            with pytest.raises(IndexUnavailableError):
                mirror.match(c)  # no stale answer: the caller places by load, as without one
            assert mirror.health().mirror_lag_s == math.inf  # out of sync until a snapshot
            server.start()  # back, empty; the publisher re-registers and republishes
            cache.update(c[12:20])
            # its next heartbeat (within a heartbeat interval) finds the registration gone
            assert wait_until(lambda: pub.tick() or (pub.connected and pub.epoch > first_epoch), 5.0)
            assert mirror.wait_synced() and mirror.match(c)["g0"].blocks == 20
            assert mirror.health().reachable and mirror.health().entries == 20, mirror.health()
        finally:
            pub.close()
            mirror.close()


def test_a_dead_group_leaves_the_mirror_within_the_ttl(redis_server):
    config = PrefixIndexConfig(heartbeat_ttl_s=0.5)
    ns = f"ttl{uuid.uuid4().hex[:6]}"
    writer = RedisPrefixIndex.from_url(redis_server.url, ns, "m", config)
    mirror = MirroredPrefixIndex(RedisPrefixIndex.from_url(redis_server.url, ns, "m", config), read_block_s=0.05)
    try:
        c = chain(10, 5)
        writer.publish("g0", writer.register_group("g0"), [BlockStored(tuple(c), None)])
        assert mirror.wait_synced() and mirror.match(c)["g0"].blocks == 10
        assert wait_until(lambda: "g0" not in mirror.match(c), 2.0)  # no beats: dead
        assert writer.match(c) == {}
    finally:
        mirror.close()
        writer.close()


def test_bad_mirror_settings_name_the_field(redis_server):
    shared = RedisPrefixIndex.from_url(redis_server.url, "bad", "m")
    with pytest.raises(ValueError, match="read_block_s"):
        MirroredPrefixIndex(shared, read_block_s=0)
    with pytest.raises(ValueError, match="retry_s"):
        MirroredPrefixIndex(shared, retry_s=0)
    shared.close()


def test_serve_keeps_routing_on_prefixes_while_redis_is_down_and_converges_after():
    """`pagefleet serve` with Redis (one in-process group: no Ray): the router matches on its
    mirror and predicts a repeated document's hit exactly as the engine reports it. Redis stops
    mid-run: requests are still served and predicted from the in-process copy; once Redis is
    back, it holds the group's inventory again and the mirror answers from it."""
    import asyncio

    from router.launch.build import build_cluster
    from router.launch.config import ServeConfig
    from router.router import RouteRequest
    from worker.sampling_params import SamplingParams

    with RedisServer() as server:
        config = ServeConfig.from_mapping(
            {"model": "builtin", "redis": server.url, "engine": {"num_blocks": 64, "max_model_len": 512}}
        )
        cluster = build_cluster(config)
        router, doc = cluster.router, [(3 * i + 1) % 1000 for i in range(96)]
        mirror = cluster.index.reader.shared
        hashes = router.hasher.hash_prompt(doc)

        def ask(question: int):
            req = RouteRequest(
                prompt_token_ids=doc + [question] * 3, params=SamplingParams(max_tokens=2, temperature=0.0)
            )

            async def run():
                return [out async for out in router.generate(req)][-1]

            out = asyncio.run(run())
            return router.records[out.request_id]

        try:
            assert isinstance(mirror, MirroredPrefixIndex)
            ask(1)
            assert wait_until(lambda: mirror.match(hashes)["group-0"].blocks == 6, 5.0)
            rec = ask(2)
            assert rec.predicted_cached_tokens == rec.actual_cached_tokens == len(doc)
            server.stop()
            # served, predicted from the mirror's copy and then from the in-process index
            assert wait_until(lambda: ask(2) and not cluster.index.reader.shared_up, 5.0)
            rec = ask(2)
            assert rec.predicted_cached_tokens == rec.actual_cached_tokens == len(doc)
            down = cluster.index.reader.health()  # unreachable; routing on the local index
            assert down.shared and not down.reachable and down.groups == 1 and down.entries >= 6
            server.start()  # empty: the group's publisher registers again and republishes
            assert wait_until(lambda: ask(3) and cluster.index.reader.shared_up and mirror.synced, 20.0)
            assert wait_until(
                lambda: mirror.match(hashes).get("group-0") is not None and mirror.match(hashes)["group-0"].blocks == 6,
                5.0,
            )
            rec = ask(4)
            assert rec.predicted_cached_tokens == rec.actual_cached_tokens == len(doc)
            assert cluster.index.reader.health().reachable
        finally:
            cluster.shutdown()


def test_serve_starts_without_redis_and_fills_it_once_it_answers(caplog):
    """Redis is down when `pagefleet serve` starts: it serves from the in-process copy (with a
    warning); once Redis answers, the group is registered there and the mirror sees it."""
    import asyncio

    from router.launch.build import build_cluster
    from router.launch.config import ServeConfig
    from router.router import RouteRequest
    from tests.redis_server import free_port
    from worker.sampling_params import SamplingParams

    server = RedisServer(port=free_port())  # not started yet
    config = ServeConfig.from_mapping(
        {"model": "builtin", "redis": server.url, "engine": {"num_blocks": 64, "max_model_len": 512}}
    )
    cluster = build_cluster(config)
    router, doc = cluster.router, [(7 * i + 2) % 1000 for i in range(64)]

    def ask(question: int):
        req = RouteRequest(prompt_token_ids=doc + [question] * 3, params=SamplingParams(max_tokens=2, temperature=0.0))

        async def run():
            return [out async for out in router.generate(req)][-1]

        return router.records[asyncio.run(run()).request_id]

    try:
        ask(1)
        rec = ask(2)
        assert rec.predicted_cached_tokens == rec.actual_cached_tokens == len(doc)
        assert not cluster.index.reader.shared_up and "unavailable" in caplog.text
        server.start()
        mirror, hashes = cluster.index.reader.shared, router.hasher.hash_prompt(doc)

        def filled() -> bool:
            ask(3)
            m = mirror.match(hashes).get("group-0") if mirror.synced else None
            return m is not None and m.blocks == len(hashes)

        assert wait_until(filled, 30.0)
    finally:
        cluster.shutdown()
        server.close()


def test_the_copy_forgets_everything_of_a_registration_that_goes():
    """Restarts, clears, evictions and deregistrations leave no mask behind (cluster/index/copy.py
    keeps block -> holders and probe -> groups tables besides each registration's own)."""
    rng = random.Random(3)
    copy = IndexCopy(ttl_s=60.0)
    docs = [chain(rng.randint(1, 300), d) for d in range(5)]
    for step in range(400):
        gid = f"g{rng.randrange(8)}"
        g = copy.groups.get(gid) or copy.register(gid, step, now=0.0)
        c = docs[rng.randrange(len(docs))]
        op = rng.random()
        if op < 0.4:
            copy.store(g, c[: rng.randint(1, len(c))])
        elif op < 0.6:
            copy.remove(g, c[rng.randint(0, len(c) - 1) :])
        elif op < 0.65:
            copy.clear(g)
        elif op < 0.9:
            copy.place(g, probe_hashes(c[: rng.randint(1, len(c))]), 0, 2.0, now=step / 100)
        else:
            copy.register(gid, step + 1000, now=0.0)  # a restart replaces the registration
    assert copy.sizes() != (0, 0)
    for gid in list(copy.groups):
        copy.drop(gid)
    assert copy.sizes() == (0, 0)
    assert copy.match(docs[0], now=1.0) == {}


def _traversed(root: object) -> int:
    """References the garbage collector follows from `root` on a full collection: the entries
    of every tracked container reachable from it."""
    seen, todo, n = set(), [root], 0
    while todo:
        o = todo.pop()
        if id(o) in seen or not gc.is_tracked(o):
            continue
        seen.add(id(o))
        refs = gc.get_referents(o)
        n += len(refs)
        todo.extend(refs)
    return n


def test_the_copys_tables_are_out_of_the_collectors_sight():
    """A router's copy holds every group's blocks: a full collection that walked them would
    stall the router for as long as the index is large (~0.2 s at 64 groups). Its tables hold
    bytes, ints and floats only, in containers the collector does not track."""
    copy = IndexCopy(ttl_s=60.0)
    small = _traversed(copy)
    for i in range(4):
        g = copy.register(f"g{i}", 1, now=0.0)
        c = chain(4096, doc=i)
        copy.store(g, c)
        copy.place(g, probe_hashes(c), 0, 30.0, now=0.0)
    assert copy.sizes()[0] == 4 * 4096
    assert _traversed(copy) - small < 2000  # (the registrations and pending lists: not the blocks)
