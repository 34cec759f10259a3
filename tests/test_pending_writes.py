"""Pending placements in the Redis index: batched writes, skipped rewrites, the shared binary
search of match, against a real redis-server."""

from __future__ import annotations

import time
import uuid

import pytest
import redis
from factories import wait_until

from cluster.index import PendingWrite, RedisPrefixIndex
from router.placement import PendingPlacements
from worker.hashing import BlockHasher, ModelFingerprint

HASHER = BlockHasher(b"pending-test-secret", ModelFingerprint("tiny-llama", block_size=4))


def chain(n_blocks: int, first_token: int = 0) -> list[bytes]:
    tokens = list(range(first_token, first_token + n_blocks * HASHER.block_size))
    return HASHER.hash_prompt(tokens)


@pytest.fixture
def indexes(redis_server):
    """(a router's index, another router's index, an admin client) over one namespace."""
    ns = f"p{uuid.uuid4().hex[:8]}"
    a, b = (RedisPrefixIndex.from_url(redis_server.url, ns, "m") for _ in range(2))
    for gid in ("g0", "g1", "g2", "g3"):
        a.register_group(gid)
    admin = redis.Redis.from_url(redis_server.url)
    yield a, b, admin
    a.close()
    b.close()
    admin.close()


def evalsha_calls(admin) -> int:
    return admin.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)


def pending(index, hashes) -> dict[str, int]:
    return {g: m.pending_blocks for g, m in index.match(hashes).items() if m.pending_blocks}


def test_a_batch_of_placements_is_one_script_call_seen_by_another_router(indexes):
    a, b, admin = indexes
    doc, other = chain(200), chain(40, first_token=9000)
    a.record_pending("g3", chain(1, first_token=7000))  # loads the script (NOSCRIPT, then retry)
    before = evalsha_calls(admin)
    a.record_pending_many([PendingWrite("g0", doc), PendingWrite("g1", other)], ttl_s=30.0)
    assert evalsha_calls(admin) - before == 1
    assert pending(b, doc) == {"g0": 200}
    assert pending(b, other) == {"g1": 40}


def test_match_searches_every_pending_group_at_once_and_keeps_each_length(indexes):
    a, b, _ = indexes
    doc = chain(200)
    # Lengths at probe positions of the 200-block chain (every block to 32, every 32nd, last).
    lengths = {"g0": 5, "g1": 32, "g2": 96, "g3": 200}
    a.record_pending_many([PendingWrite(g, doc[:n]) for g, n in lengths.items()], ttl_s=30.0)
    assert pending(b, doc) == lengths
    assert pending(b, doc[:64]) == {"g0": 5, "g1": 32, "g2": 64, "g3": 64}
    assert pending(b, chain(200, first_token=1)) == {}


def test_a_new_registration_does_not_inherit_pending_placements(indexes):
    a, b, _ = indexes
    doc = chain(8)
    a.record_pending("g0", doc, ttl_s=30.0)
    assert pending(b, doc) == {"g0": 8}
    a.register_group("g0")  # restarted: a new epoch
    assert pending(b, doc) == {}


def test_expired_entries_are_dropped_by_later_writes(indexes):
    a, _, admin = indexes
    a.record_pending("g0", chain(40), ttl_s=0.2)
    key = f"{a.prefix}pendh"
    entries = admin.hlen(key)
    assert entries == 33  # probe positions of 40 blocks: 0..31 and the last
    time.sleep(0.3)
    a.record_pending("g1", chain(2, first_token=5000), ttl_s=30.0)
    assert admin.hlen(key) == 2 and admin.zcard(f"{a.prefix}pendq") == 2


def test_a_fresh_placement_is_not_rewritten_and_stays_visible_until_its_deadline(indexes):
    a, b, admin = indexes
    ttl = 1.5
    placements = PendingPlacements(a, ttl_s=ttl)
    doc = chain(100)
    t0 = time.monotonic()
    placements.record("g0", doc)
    assert placements.flush()
    before = evalsha_calls(admin)
    placements.record("g0", doc)  # the same chain again, well within half a TTL
    assert placements.flush()
    assert evalsha_calls(admin) == before  # nothing written
    assert pending(b, doc) == {"g0": 100}
    # Still visible until the first write's deadline, gone soon after it.
    assert wait_until(lambda: pending(b, doc) == {}, timeout_s=ttl + 1.0)
    assert time.monotonic() - t0 >= ttl - 0.1


def test_a_longer_chain_writes_its_tail_with_the_documents_deadline(indexes):
    a, b, admin = indexes
    placements = PendingPlacements(a, ttl_s=30.0)
    doc = chain(100)
    longer = chain(160)
    assert longer[:100] == doc
    placements.record("g1", doc)
    assert placements.flush()
    entries = admin.hlen(f"{a.prefix}pendh")
    placements.record("g1", longer)
    assert placements.flush()
    # Only the probes past the document were written (positions 127, 159), with the deadline
    # of the document's probes, so match's binary search sees one deadline along the chain.
    assert admin.hlen(f"{a.prefix}pendh") == entries + 2
    assert len(set(admin.hvals(f"{a.prefix}pendh"))) == 1
    assert pending(b, longer) == {"g1": 160}
    assert pending(b, doc) == {"g1": 100}


def test_placements_are_unconfirmed_until_their_write_returns(indexes):
    a, b, _ = indexes
    placements = PendingPlacements(a, ttl_s=30.0)
    docs = [chain(20, first_token=100 * i) for i in range(3)]
    for i, doc in enumerate(docs):
        placements.record(f"g{i}", doc)
    assert {p.group_id for p in placements.unconfirmed()} <= {"g0", "g1", "g2"}
    assert placements.flush()
    assert placements.unconfirmed() == []
    for i, doc in enumerate(docs):
        assert pending(b, doc) == {f"g{i}": 20}
