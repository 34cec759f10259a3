"""The prefix index against a real redis-server (and the in-process backend under the same
tests), with block hashes from worker/hashing.py."""

from __future__ import annotations

import json
import logging
import time
import uuid

import pytest
import redis
from factories import wait_until

from cluster.index import (
    GroupPublisher,
    IndexPublisher,
    InMemoryPrefixIndex,
    MirroredPrefixIndex,
    PrefixIndexConfig,
    PublisherConfig,
    RedisPrefixIndex,
    StaleEpochError,
)
from tests.redis_server import RedisServer
from worker.hashing import BlockHasher, ModelFingerprint
from worker.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

HASHER = BlockHasher(b"test-cluster-secret", ModelFingerprint("tiny-llama", block_size=4))


def chain(n_blocks: int, first_token: int = 0, salt: str | None = None) -> list[bytes]:
    tokens = list(range(first_token, first_token + n_blocks * HASHER.block_size))
    return HASHER.hash_prompt(tokens, cache_salt=salt)


def stored(hashes) -> BlockStored:
    return BlockStored(tuple(hashes), None)


def blocks(index, hashes) -> dict[str, int]:
    m = index.match(hashes)
    # a policy reads only the answers the match says it touched: every one with a hit is
    assert {g for g, a in m.items() if a.expected_blocks} <= set(m.touched) <= set(m)
    return {g: a.blocks for g, a in m.items()}


class CaughtUpMirror(MirroredPrefixIndex):
    """A mirror whose every match first waits until its copy holds every write made so far:
    what these tests check is the copy's answer, not how fast the log arrives. The groups'
    side (register, publish, ...) goes to the Redis index it mirrors."""

    def match(self, block_hashes):
        assert self.wait_synced(), "the mirror did not catch up with the log"
        return super().match(block_hashes)

    def __getattr__(self, name: str):
        return getattr(self.shared, name)


@pytest.fixture(params=["memory", "redis", "mirror"])
def make_index(request):
    """make_index(**config) -> a client of one shared index; each call is another 'router'.

    In memory there is one process, so every call returns the same index. "mirror" answers
    matches from a local copy fed by the Redis index's log (cluster/index/mirror.py).
    """
    namespace = f"t{uuid.uuid4().hex[:8]}"
    made = []

    def make(**config):
        cfg = PrefixIndexConfig(**config)
        if request.param == "memory":
            if not made:
                made.append(InMemoryPrefixIndex(cfg))
            return made[0]
        server = request.getfixturevalue("redis_server")
        shared = RedisPrefixIndex.from_url(server.url, namespace, "m1", cfg)
        made.append(CaughtUpMirror(shared) if request.param == "mirror" else shared)
        return made[-1]

    yield make
    for index in made:
        index.close()


def test_stored_events_become_entries_and_leave(make_index):
    index = make_index()
    c = chain(6)
    epoch = index.register_group("g0")
    index.publish("g0", epoch, [stored(c[:4])])
    index.publish("g0", epoch, [BlockStored(tuple(c[4:]), c[3])])
    assert blocks(index, c) == {"g0": 6}
    assert index.inventory_stats().entries == 6
    index.publish("g0", epoch, [BlockRemoved((c[5],))])
    assert blocks(index, c) == {"g0": 5}
    index.publish("g0", epoch, [AllBlocksCleared()])
    assert blocks(index, c) == {"g0": 0}
    assert index.inventory_stats().entries == 0
    # One step's batch applies in order: the last event wins.
    index.publish("g0", epoch, [stored(c[:3]), BlockRemoved(tuple(c[:3])), stored(c[:2])])
    assert blocks(index, c) == {"g0": 2}


def test_the_index_follows_the_device_tier_alone(make_index):
    """Events of the tiers under the pool (host, disk) do not change the device's entries."""
    index = make_index()
    c = chain(4)
    epoch = index.register_group("g0")
    events = [
        stored(c),
        BlockRemoved(tuple(c[2:])),
        BlockStored(tuple(c[2:]), None, "host"),
        BlockRemoved(tuple(c[:1]), "host"),
    ]
    index.publish("g0", epoch, events)
    assert blocks(index, c) == {"g0": 2}


def test_match_counts_leading_blocks_only(make_index):
    index = make_index()
    c = chain(6)
    e0, e1 = index.register_group("g0"), index.register_group("g1")
    index.register_group("g2")  # live, holds nothing
    index.publish("g0", e0, [stored(c[:2] + c[3:])])  # gap at block 2
    index.publish("g1", e1, [stored(c[1:])])  # everything but block 0
    assert blocks(index, c) == {"g0": 2, "g1": 0, "g2": 0}
    assert blocks(index, c[:1]) == {"g0": 1, "g1": 0, "g2": 0}
    assert blocks(index, chain(6, first_token=1)) == {"g0": 0, "g1": 0, "g2": 0}
    assert blocks(index, []) == {"g0": 0, "g1": 0, "g2": 0}
    index.publish("g1", e1, [stored(c[:1])])
    assert blocks(index, c)["g1"] == 6


def test_lapsed_heartbeat_stops_matching_within_the_ttl(make_index):
    ttl = 1.0
    index = make_index(heartbeat_ttl_s=ttl)
    c = chain(3)
    beating, silent = index.register_group("beating"), index.register_group("silent")
    publishing = index.register_group("publishing")
    for gid, epoch in (("beating", beating), ("silent", silent), ("publishing", publishing)):
        index.publish(gid, epoch, [stored(c)])
    t0 = time.monotonic()
    while time.monotonic() - t0 < 1.5 * ttl:  # two groups stay alive past the third's TTL
        index.heartbeat("beating", beating)
        index.publish("publishing", publishing, [])  # a step with no events still counts
        time.sleep(ttl / 5)
    assert blocks(index, c) == {"beating": 3, "publishing": 3}
    with pytest.raises(StaleEpochError):
        index.heartbeat("silent", silent)  # a lapsed registration is dead for good
    with pytest.raises(StaleEpochError):
        index.publish("silent", silent, [stored(c)])
    assert index.cleanup() == 1
    assert index.inventory_stats().entries == 6


def test_reregistered_group_never_matches_its_old_epoch(make_index):
    index = make_index()
    c = chain(4)
    old = index.register_group("g0")
    index.publish("g0", old, [stored(c)])
    new = index.register_group("g0")  # the group restarted
    assert new > old
    assert {g: (m.epoch, m.blocks) for g, m in index.match(c).items()} == {"g0": (new, 0)}
    for fenced in (
        lambda: index.publish("g0", old, [stored(c)]),
        lambda: index.heartbeat("g0", old),
    ):
        with pytest.raises(StaleEpochError):
            fenced()
    index.publish("g0", new, [stored(c[:2])])
    index.deregister("g0", old)  # stale: a no-op
    assert blocks(index, c) == {"g0": 2}
    index.deregister("g0", new)
    assert index.match(c) == {}


def test_a_fenced_off_epoch_cannot_take_its_group_back(make_index):
    """An old process of a group, re-registering after its registration lapsed, is refused
    once a newer process registered (it would take over, be taken over, and so on); the live
    process re-registers after a lapse as before, and a new start always takes over."""
    index = make_index()
    c = chain(3)
    old = index.register_group("g0")
    new = index.register_group("g0")  # the replacement: a new start takes over
    index.publish("g0", new, [stored(c)])
    with pytest.raises(StaleEpochError):
        index.register_group("g0", previous=old)
    assert {g: (m.epoch, m.blocks) for g, m in index.match(c).items()} == {"g0": (new, 3)}
    again = index.register_group("g0", previous=new)  # the live one, after a lapse
    assert again > new and {g: m.epoch for g, m in index.match(c).items()} == {"g0": again}
    with pytest.raises(StaleEpochError):
        index.register_group("g0", previous=new)


def test_a_fenced_off_publisher_stops_and_leaves_its_replacement_alone(redis_server):
    """The old rank of a group whose node was cut off publishes again after its replacement
    registered: it is fenced off for good (once told), the replacement keeps one registration,
    and once the replacement leaves no row of the group is left. Before, the old publisher
    registered again unconditionally and the two took the group from each other at every
    step (20-39 new epochs a second)."""
    group_side = RedisPrefixIndex.from_url(redis_server.url, "fence", "m1")
    router = RedisPrefixIndex.from_url(redis_server.url, "fence", "m1")
    admin = redis.Redis.from_url(redis_server.url)
    c = chain(4)
    told = []
    config = PublisherConfig(heartbeat_interval_s=0.05)
    old = IndexPublisher(group_side, "g0", lambda: set(c[:2]), config, on_fenced=lambda: told.append(1))
    new = IndexPublisher(group_side, "g0", lambda: set(c), config)
    assert new.epoch > old.epoch
    for _ in range(20):  # both keep stepping, as the two ranks did
        old.publish_step([stored(c[:1])])
        new.publish_step([])
        time.sleep(0.01)
    assert old.fenced and not new.fenced and told == [1]
    assert int(admin.hget("pf:fence:m1:epochs", "g0")) == new.epoch  # no epoch handed out since
    assert {g: (m.epoch, m.blocks) for g, m in router.match(c).items()} == {"g0": (new.epoch, 4)}
    old.close()  # fenced: deregisters nothing
    assert router.match(c)["g0"].epoch == new.epoch
    new.close()
    old.publish_step([stored(c)])
    assert router.match(c) == {} and not list(admin.scan_iter("pf:fence:m1:hb:*"))
    assert not list(admin.scan_iter("pf:fence:m1:inv:*"))


def test_pending_placements_show_up_for_other_routers_and_expire(make_index):
    router_a, router_b = make_index(), make_index()
    c = chain(5)
    e0 = router_a.register_group("g0")
    router_a.register_group("g1")
    router_a.publish("g0", e0, [stored(c[:2])])
    router_a.record_pending("g1", c, ttl_s=1.0)
    m = router_b.match(c)
    assert (m["g1"].blocks, m["g1"].pending_blocks, m["g1"].expected_blocks) == (0, 5, 5)
    assert (m["g0"].blocks, m["g0"].pending_blocks, m["g0"].expected_blocks) == (2, 0, 2)
    assert router_b.match(c[:3])["g1"].pending_blocks == 3
    assert router_b.match(chain(5, first_token=7))["g1"].pending_blocks == 0
    router_a.record_pending("g1", c[:2], ttl_s=30.0)  # a second placement outlives the first
    assert wait_until(lambda: router_b.match(c)["g1"].pending_blocks == 2, timeout_s=2.5)


def test_tenants_with_different_salts_never_share_blocks(make_index):
    index = make_index()
    tenant_a, tenant_b = chain(8, salt="tenant-a"), chain(8, salt="tenant-b")
    assert not set(tenant_a) & set(tenant_b)  # same prompt, disjoint chains
    epoch = index.register_group("g0")
    index.publish("g0", epoch, [stored(tenant_a)])
    assert blocks(index, tenant_a) == {"g0": 8}
    assert blocks(index, tenant_b) == {"g0": 0}


def test_publisher_batches_per_step_and_rate_limits_heartbeats():
    now = [0.0]
    calls = {"heartbeat": 0, "publish": 0}

    class CountingIndex(InMemoryPrefixIndex):  # the real index, with its calls counted
        def publish(self, *a):
            calls["publish"] += 1
            super().publish(*a)

        def heartbeat(self, *a):
            calls["heartbeat"] += 1
            super().heartbeat(*a)

    index = CountingIndex(PrefixIndexConfig(heartbeat_ttl_s=3.0), clock=lambda: now[0])
    cache: set[bytes] = set()
    config = PublisherConfig(heartbeat_interval_s=1.0)
    pub = IndexPublisher(index, "g0", lambda: set(cache), config, clock=lambda: now[0])
    c = chain(4)
    pub.sink(stored(c[:2]))
    pub.sink(stored(c[2:]))
    assert blocks(index, c) == {"g0": 0}  # buffered until the step ends
    for _ in range(150):  # 150 steps of 10 ms: one batch of events, one heartbeat (at 1 s)
        now[0] += 0.01
        pub.tick()
    assert blocks(index, c) == {"g0": 4}
    assert calls["publish"] == 1 and calls["heartbeat"] == 1
    # The engine stalled past the TTL: the next tick registers again and republishes.
    cache.update(c)
    now[0] += 5.0
    assert index.match(c) == {}
    pub.tick()
    assert pub.epoch == 2 and blocks(index, c) == {"g0": 4}
    pub.close()
    assert index.match(c) == {}


def test_a_group_stays_matched_through_a_step_longer_than_the_ttl(redis_server):
    """A real model's long prefill step on a CPU: the group's beat thread keeps its
    registration alive while the step thread is busy, so no re-registration follows."""
    config = PrefixIndexConfig(heartbeat_ttl_s=0.6)
    group_side = RedisPrefixIndex.from_url(redis_server.url, "beat", "m1", config)
    router = RedisPrefixIndex.from_url(redis_server.url, "beat", "m1", config)
    c = chain(4)
    pub = GroupPublisher(group_side, "g0", lambda: set(c), PublisherConfig(heartbeat_interval_s=0.2))
    pub.publish_step([])
    epoch = pub.epoch
    time.sleep(2.0)  # one step of 2 s: no tick, more than three TTLs
    assert blocks(router, c) == {"g0": 4}
    pub.publish_step([])
    assert pub.epoch == epoch  # still the first registration
    pub.close()  # the beats stop and the group deregisters
    assert wait_until(lambda: router.match(c) == {}, 3.0)


def test_two_routers_over_one_redis_see_the_same_answer(redis_server):
    group_side, a, b = (RedisPrefixIndex.from_url(redis_server.url, "two", "m1") for _ in range(3))
    c = chain(5)
    for i, gid in enumerate(("g0", "g1", "g2")):
        epoch = group_side.register_group(gid)
        group_side.publish(gid, epoch, [stored(c[: i + 2])])
    assert a.match(c) == b.match(c)
    assert blocks(a, c) == {"g0": 2, "g1": 3, "g2": 4}


def test_match_is_one_round_trip(redis_server):
    router = RedisPrefixIndex.from_url(redis_server.url, "trip", "m1")
    admin = redis.Redis.from_url(redis_server.url)
    name = router.client.client_getname()
    c = chain(64)
    for i in range(4):
        epoch = router.register_group(f"g{i}")
        router.publish(f"g{i}", epoch, [stored(c[: 16 * (i + 1)])])
    router.match(c)  # warm: connection handshake and script loading happen once
    admin.config_set("slowlog-log-slower-than", 0)  # log every command with its client name
    admin.slowlog_reset()
    evalsha_before = admin.info("commandstats")["cmdstat_evalsha"]["calls"]
    assert blocks(router, c) == {"g0": 16, "g1": 32, "g2": 48, "g3": 64}
    evalsha_after = admin.info("commandstats")["cmdstat_evalsha"]["calls"]
    sent = [e["command"] for e in admin.slowlog_get(1000) if e["client_name"] == name.encode()]
    admin.config_set("slowlog-log-slower-than", 10000)
    assert len(sent) == 1 and sent[0].startswith(b"EVALSHA")
    assert evalsha_after - evalsha_before == 1


def test_match_reads_every_group_in_bulk_and_skips_empty_pending_sets(redis_server):
    index = RedisPrefixIndex.from_url(redis_server.url, "bulk", "m1")
    admin = redis.Redis.from_url(redis_server.url)
    c = chain(8)
    for i in range(4):
        index.register_group(f"g{i}")

    def commands_in_match() -> dict[str, int]:
        def calls():
            stats = admin.info("commandstats")
            names = ("get", "mget", "sismember", "smismember", "hmget", "zscore")
            return {k: stats.get(f"cmdstat_{k}", {}).get("calls", 0) for k in names}

        before = calls()
        index.match(c)
        return {k: v - before[k] for k, v in calls().items()}

    index.match(c)  # warm: script loading
    # Groups holding none of the chain and nothing pending: one SISMEMBER of its first block
    # each, no further probe, no pending lookup.
    nothing = {"get": 0, "mget": 1, "sismember": 4, "smismember": 0, "hmget": 0, "zscore": 0}
    assert commands_in_match() == nothing
    epoch = index.register_group("g2")
    index.publish("g2", epoch, [stored(c)])
    assert commands_in_match()["smismember"] >= 1  # only the holder is probed further
    index.record_pending("g1", c)
    index.record_pending("g3", c[:5])
    # Pending on two groups: one HMGET of the first block for all groups, then one per step of
    # a binary search run for both groups together (8 probes: 3 steps), not one per group.
    assert 2 <= commands_in_match()["hmget"] <= 4
    m = index.match(c)
    assert (m["g1"].pending_blocks, m["g3"].pending_blocks, m["g0"].pending_blocks) == (8, 5, 0)


def test_publisher_survives_redis_going_down_and_republishes(caplog):
    c = chain(6)
    cache: set[bytes] = set()
    config = PublisherConfig(retry_initial_s=0.05, retry_max_s=0.2)
    with RedisServer() as server:
        group_side = RedisPrefixIndex.from_url(server.url, "down", "m1", socket_timeout_s=0.5)
        router = RedisPrefixIndex.from_url(server.url, "down", "m1")
        pub = IndexPublisher(group_side, "g0", lambda: set(cache), config)

        def engine_step(event=None):  # what the block manager and engine loop do
            if isinstance(event, BlockStored):
                cache.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                cache.difference_update(event.block_hashes)
            if event is not None:
                pub.sink(event)
            pub.tick()

        engine_step(stored(c[:3]))
        assert blocks(router, c) == {"g0": 3}
        server.stop()
        with caplog.at_level(logging.WARNING, logger="cluster.index"):
            engine_step(stored(c[3:]))  # must not raise
            engine_step(BlockRemoved((c[5],)))
            for _ in range(5):
                engine_step()
                time.sleep(0.05)
        assert not pub.connected
        assert len(caplog.records) == 1 and "unavailable" in caplog.records[0].getMessage()
        server.start()  # back, empty: no keys, no scripts
        assert wait_until(lambda: engine_step() or pub.connected, timeout_s=5.0)
        m = router.match(c)  # the router's client reconnects and reloads the script
        assert m["g0"].blocks == 5
        pub.close()
        assert router.match(c) == {}


def test_a_dead_groups_keys_expire_by_themselves(redis_server):
    index = RedisPrefixIndex.from_url(redis_server.url, "keys", "m1", PrefixIndexConfig(heartbeat_ttl_s=0.6))
    c = chain(4)
    for gid in ("g0", "g1"):
        epoch = index.register_group(gid)
        index.publish(gid, epoch, [stored(c)])
    index.record_pending("g0", c, ttl_s=0.3)
    index.deregister("g1", epoch)

    def keys():
        # The change log (and its counter) outlives groups: it expires an hour after the last
        # write, so mirrors can follow it through any gap between groups.
        return sorted(k.decode() for k in index.client.scan_iter(match="pf:keys:m1:*") if b":log" not in k)

    assert keys() == [f"pf:keys:m1:{k}" for k in ("epochs", "groups", "hb:g0", "inv:g0", "pendh", "pendq")]
    assert 0 < index.client.pttl("pf:keys:m1:log") <= 3_600_000
    assert wait_until(lambda: keys() == ["pf:keys:m1:epochs", "pf:keys:m1:groups"], 3.0)
    assert index.match(c) == {}
    assert index.cleanup() == 1  # forgets the registration; the epoch counter stays
    assert keys() == ["pf:keys:m1:epochs"]


def test_namespaces_keep_models_apart(redis_server):
    model_a = RedisPrefixIndex.from_url(redis_server.url, "ns", "model-a")
    model_b = RedisPrefixIndex.from_url(redis_server.url, "ns", "model-b")
    c = chain(2)
    model_a.publish("g0", model_a.register_group("g0"), [stored(c)])
    assert blocks(model_a, c) == {"g0": 2}
    assert model_b.match(c) == {}


def test_inventory_stats_measure_bytes_per_block(redis_server):
    # A long TTL: on a loaded machine the keys must not expire between the calls below.
    config = PrefixIndexConfig(heartbeat_ttl_s=600.0)
    index = RedisPrefixIndex.from_url(redis_server.url, "stats", "m1", config)
    admin = redis.Redis.from_url(redis_server.url)
    c = chain(4000)
    before = admin.info("memory")["used_memory"]
    for gid, part in (("g0", c[:3000]), ("g1", c[1000:])):  # 2000 blocks held by both
        epoch = index.register_group(gid)
        index.publish(gid, epoch, [stored(part)])
    grown = admin.info("memory")["used_memory"] - before
    stats = index.inventory_stats()
    assert (stats.entries, stats.blocks, stats.groups) == (6000, 4000, 2)
    # MEMORY USAGE of the keys and the change log agrees with the allocator's growth within a
    # factor of 2.5 (the growth also holds the sets' rehash tables and allocator slack); a
    # 16-byte hash cannot cost less than 16 bytes.
    assert 0.4 < (stats.bytes_total + stats.log_bytes) / grown < 2.5, (stats, grown)
    assert 16 <= stats.bytes_per_block <= 256
    assert stats.log_bytes >= 16 * stats.entries  # the log holds every published hash, once
    line = {"bench": "redis_prefix_index_memory", "entries": stats.entries}
    line |= {"bytes_per_block": round(stats.bytes_per_block, 1)}
    line |= {"used_memory_delta_per_block": round(grown / stats.entries, 1)}
    line |= {"log_bytes": stats.log_bytes}
    print(json.dumps(line))


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: PrefixIndexConfig(heartbeat_ttl_s=0), "heartbeat_ttl_s"),
        (lambda: PublisherConfig(retry_initial_s=1.0, retry_max_s=0.5), "retry_max_s"),
        (lambda: InMemoryPrefixIndex().register_group("a:b"), "group_id"),
        (lambda: RedisPrefixIndex(None, "c", "has space"), "model"),
    ],
)
def test_bad_configuration_names_the_field(make, field):
    with pytest.raises(ValueError, match=field):
        make()


def test_script_calls_reuse_connections_across_short_lived_threads(redis_server):
    """A router's pending writer is a thread that exits when idle and starts again; its calls
    must not leave a connection behind each time."""
    import threading

    index = RedisPrefixIndex.from_url(redis_server.url, f"conn{uuid.uuid4().hex[:6]}", "m1")
    admin = redis.Redis.from_url(redis_server.url)
    name = index.client.client_getname() or index.client.connection_pool.connection_kwargs["client_name"]
    epoch = index.register_group("g0")
    for _ in range(20):
        t = threading.Thread(target=index.heartbeat, args=("g0", epoch))
        t.start()
        t.join()
    ours = [c for c in admin.client_list() if c["name"] == name]
    assert 1 <= len(ours) <= 2  # the script connection (and the client's own, from above)
    index.close()
    assert wait_until(lambda: not [c for c in admin.client_list() if c["name"] == name], 2.0)
