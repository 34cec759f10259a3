"""The per-tier index stays exact through restarts, against a real redis-server and real groups
with device, host and disk tiers: a group killed (SIGKILL, in a process of its own) and replaced
under a new epoch, a router's mirror discarded and built again, Redis killed and started empty on
the same port. Within a bound derived from the publishers' and the index's intervals, the
index's inventory per tier (in Redis and in a router's mirror) equals each group's block manager,
and no match names a block a group no longer holds.

The bounds (seconds), from the defaults a `LocalGroup` runs with:

- a killed group's entries leave the index when its registration lapses: `heartbeat_ttl_s`
  after its last beat, plus one log delivery to a mirror;
- a replacement (a new start takes the group over at once) holds exactly its own blocks as soon
  as it registered: one publisher wake-up and one log delivery after its steps;
- a rebuilt mirror equals Redis once it loaded its snapshot: one log read;
- after Redis comes back from an outage of `d` seconds, a publisher's next try comes within
  its current backoff, at most `min(retry_max_s, 2 d + retry_initial_s)` (the backoff doubles
  from `retry_initial_s` after each failed try, so it is at most twice the time already down),
  plus one heartbeat interval for the beat that finds its registration gone; the mirror reloads
  within its `retry_s`.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from factories import wait_until

from cluster.index import FailoverReader, InMemoryPrefixIndex, MirroredPrefixIndex, PublisherConfig, RedisPrefixIndex
from cluster.index.types import GroupMatch, IndexUnavailableError, PrefixIndexConfig
from cluster.local_group import LocalGroup
from pagefleet.llm import LLM, engine_config
from worker.kv_events import DEVICE, DISK, HOST, MEDIUMS
from worker.model.builtin_model import make_model_dir
from worker.protocol import GenerationRequest
from worker.sampling_params import SamplingParams

PUBLISHER, INDEX = PublisherConfig(), PrefixIndexConfig()
READ_BLOCK_S, MIRROR_RETRY_S = 0.1, 0.5  # the mirror's defaults
SLACK_S = 1.0  # a step, a snapshot script and scheduling on a busy 2-core machine
# A killed group's entries are gone from every reader within this.
KILLED_GONE_BOUND_S = INDEX.heartbeat_ttl_s + READ_BLOCK_S + SLACK_S
# A replacement's (or any live group's) steps are in every reader within this.
LIVE_BOUND_S = PUBLISHER.heartbeat_interval_s / 2 + READ_BLOCK_S + SLACK_S
# A rebuilt mirror equals Redis within this.
MIRROR_BOUND_S = 2 * READ_BLOCK_S + SLACK_S


def republish_bound_s(outage_s: float) -> float:
    """How long after Redis is back (from an outage of `outage_s`) every group is republished in
    Redis and in a mirror."""
    backoff = min(PUBLISHER.retry_max_s, 2 * outage_s + PUBLISHER.retry_initial_s)
    return backoff + PUBLISHER.heartbeat_interval_s + MIRROR_RETRY_S + READ_BLOCK_S + SLACK_S


ROOT = Path(__file__).resolve().parents[1]
OPTS = dict(dtype="float32", block_size=8, num_blocks=24, max_model_len=128, watermark=0.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("index-restarts"), seed=1)


@pytest.fixture(scope="module")
def block_bytes(model_dir) -> int:
    stats = LLM(str(model_dir), **{**OPTS, "num_blocks": 16}).engine.stats()
    return stats["kv_bytes_per_token"] * stats["block_size"]


def tiered_config(model_dir, block_bytes: int, disk_dir: Path):
    """A pool of 2-3 documents over a host tier of one and a disk tier of many."""
    return engine_config(
        str(model_dir),
        kv_host_bytes=12 * block_bytes,
        kv_disk_bytes=200 * block_bytes,
        kv_disk_dir=str(disk_dir),
        **OPTS,
    )


def documents(seed: int, n: int = 4) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(80)] for _ in range(n)]


def visit(group: LocalGroup, prompts: list[list[int]]) -> None:
    async def run() -> None:
        for prompt in prompts:
            async for _ in group.generate(GenerationRequest(prompt, SamplingParams(temperature=0.0, max_tokens=2))):
                pass

    asyncio.run(run())


def tiers_of(group: LocalGroup) -> dict[str, frozenset[bytes]]:
    """The group's block manager's hashes per medium, taken between two of its steps."""
    hashes = group.engine.call(lambda e: e.tier_hashes()).result(10)
    return {m: frozenset(hashes.get(m, ())) for m in MEDIUMS}


def lead(chain: list[bytes], held: frozenset[bytes]) -> int:
    n = 0
    while n < len(chain) and chain[n] in held:
        n += 1
    return n


def walked(tiers: dict[str, frozenset[bytes]], chain: list[bytes]) -> tuple[int, int, int]:
    """(device, host, disk) blocks as the block manager follows the chain (test_tier_index.py)."""
    d = lead(chain, tiers[DEVICE])
    u = max(d, lead(chain, tiers[DEVICE] | tiers[HOST]))
    return d, u - d, max(u, lead(chain, tiers[DEVICE] | tiers[HOST] | tiers[DISK])) - u


def answered(m: GroupMatch | None) -> tuple[int, int, int]:
    return (0, 0, 0) if m is None else (m.blocks, m.host_blocks, m.disk_blocks)


def exact(reader, groups: dict[str, dict[str, frozenset[bytes]]], chains) -> bool:
    """The reader's inventory of every group, and its match of every chain, are the groups'."""
    try:
        if any(reader.inventory(g) != tiers for g, tiers in groups.items()):
            return False
        return all(answered(reader.match(c).get(g)) == walked(tiers, c) for c in chains for g, tiers in groups.items())
    except IndexUnavailableError:
        return False


def within(bound_s: float, predicate) -> float:
    """Seconds until `predicate` held; fails past `bound_s`."""
    started = time.monotonic()
    assert wait_until(predicate, bound_s, 0.05), f"not within the bound of {bound_s:.1f} s"
    return time.monotonic() - started


@pytest.fixture
def ns() -> str:
    return f"r{uuid.uuid4().hex[:8]}"


# ---- a group killed and replaced -------------------------------------------------------------

_KILLED_PROCESS = """
import asyncio, json, sys, time
from cluster.index import RedisPrefixIndex
from cluster.local_group import LocalGroup
from pagefleet.llm import engine_config
from worker.protocol import GenerationRequest
from worker.sampling_params import SamplingParams
url, ns, configs, prompts = json.loads(sys.argv[1])
groups = [LocalGroup(engine_config(**c), RedisPrefixIndex.from_url(url, ns, "m"), group_id=g) for g, c in configs.items()]
async def run():
    for g in groups:
        for p in prompts:
            async for _ in g.generate(GenerationRequest(p, SamplingParams(temperature=0.0, max_tokens=2))):
                pass
asyncio.run(run())
held = {g.group_id: g.engine.call(lambda e: e.tier_hashes()).result(10) for g in groups}
print(json.dumps({g: {m: sorted(h.hex() for h in hs) for m, hs in t.items()} for g, t in held.items()}), flush=True)
time.sleep(600)
"""


def union(tiers: dict[str, frozenset[bytes]]) -> frozenset[bytes]:
    return frozenset().union(*tiers.values())


def test_killed_groups_leave_the_index_and_a_replacement_holds_only_its_own_blocks(
    model_dir, block_bytes, redis_server, ns, tmp_path
):
    """g0 and g1 run in a process of their own, fill their tiers, and the process is SIGKILLed
    (no deregistration). g0 is replaced at once (this process, a new epoch, other documents):
    its registration drops every tier of the old one, and within LIVE_BOUND_S Redis and a
    mirror hold exactly the replacement's blocks. g1 is not replaced: within KILLED_GONE_BOUND_S
    neither names it, and no match predicts a block of it."""
    shared = RedisPrefixIndex.from_url(redis_server.url, ns, "m")
    mirror = MirroredPrefixIndex(RedisPrefixIndex.from_url(redis_server.url, ns, "m"))
    old_docs, new_docs = documents(1), documents(2)
    configs = {
        g: dict(
            model=str(model_dir),
            kv_host_bytes=12 * block_bytes,
            kv_disk_bytes=200 * block_bytes,
            kv_disk_dir=str(tmp_path / g),
            **OPTS,
        )
        for g in ("g0", "g1")
    }
    args = json.dumps([redis_server.url, ns, configs, [d + [5] for d in old_docs]])
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_PROCESS, args], stdout=subprocess.PIPE, cwd=ROOT, env=env)
    group = None
    try:
        line = proc.stdout.readline()
        assert line, "the groups' process ended before it served"
        old = {
            g: {m: frozenset(bytes.fromhex(h) for h in t.get(m, ())) for m in MEDIUMS}
            for g, t in json.loads(line).items()
        }
        assert all(t[HOST] and t[DISK] for t in old.values()), "the visits should fill the lower tiers"
        within(LIVE_BOUND_S, lambda: exact(shared, old, []) and exact(mirror, old, []))
        old_epoch = int(shared.client.hget(shared.prefix + "groups", "g0"))
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        killed_at = time.monotonic()

        group = LocalGroup(tiered_config(model_dir, block_bytes, tmp_path / "new"), shared, group_id="g0")
        assert int(shared.client.hget(shared.prefix + "groups", "g0")) > old_epoch
        nothing = {m: frozenset() for m in MEDIUMS}
        # (g0's replacement as it registered: nothing yet; its idle steps publish no blocks.)
        took = within(LIVE_BOUND_S, lambda: shared.inventory("g0") == nothing and mirror.inventory("g0") == nothing)
        assert time.monotonic() - killed_at < INDEX.heartbeat_ttl_s, "the replacement should beat the TTL"
        print(f"replacement registered: the old epoch's tiers gone after {took:.2f} s (bound {LIVE_BOUND_S:.1f} s)")
        chains = [group.hasher.hash_prompt(d) for d in old_docs + new_docs]
        visit(group, [d + [6] for d in new_docs])
        new = tiers_of(group)
        assert new[HOST], "the replacement's visits should fill its host tier"
        took = within(LIVE_BOUND_S, lambda: exact(shared, {"g0": new}, chains) and exact(mirror, {"g0": new}, chains))
        print(f"replacement exact after {took:.2f} s (bound {LIVE_BOUND_S:.1f} s)")
        assert union(old["g0"]) - union(new), "the documents should differ"
        for reader in (shared, mirror):
            assert not (union(old["g0"]) - union(new)) & union(reader.inventory("g0"))

        # A router started just before g1's registration lapses: its mirror's snapshot holds
        # g1, and must let it go when Redis does, not a whole TTL after the snapshot.
        time.sleep(max(0.0, INDEX.heartbeat_ttl_s - 0.8 - (time.monotonic() - killed_at)))
        assert shared.inventory("g1") == old["g1"], "g1's registration should not have lapsed yet"
        late = MirroredPrefixIndex(RedisPrefixIndex.from_url(redis_server.url, ns, "m"))
        readers = (shared, mirror, late)
        try:
            assert wait_until(lambda: late.inventory("g1") == old["g1"], 0.5, 0.01)

            def lapsed() -> bool:  # while a router goes on placing requests on g1
                late.record_pending("g1", chains[0][:4], ttl_s=0.5)
                return all(r.inventory("g1") is None for r in readers)

            within(KILLED_GONE_BOUND_S - (time.monotonic() - killed_at), lapsed)
            print(f"killed g1 gone from the index {time.monotonic() - killed_at:.2f} s after the kill")
            for reader in readers:  # nothing predicted on what the dead process held
                assert all(not any(answered(reader.match(c).get("g1"))) for c in chains), type(reader)
        finally:
            late.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if group is not None:
            group.shutdown()
        mirror.close()
        shared.close()


# ---- a router's mirror discarded and rebuilt, and Redis restarted -----------------------------


@pytest.fixture
def two_groups(model_dir, block_bytes, redis_server, ns, tmp_path):
    """Two tiered groups publishing to this process's index and to Redis, with documents
    visited so that every tier holds blocks; (groups, memory, shared, chains)."""
    memory, shared = InMemoryPrefixIndex(), RedisPrefixIndex.from_url(redis_server.url, ns, "m")
    groups = [
        LocalGroup(tiered_config(model_dir, block_bytes, tmp_path / f"g{i}"), [memory, shared], group_id=f"g{i}")
        for i in range(2)
    ]
    docs = documents(3, 6)
    chains = [groups[0].hasher.hash_prompt(d) for d in docs]
    try:
        visit(groups[0], [d + [5] for d in docs[:4]])
        visit(groups[1], [d + [7] for d in docs[2:]])
        yield groups, memory, shared, docs, chains
    finally:
        for g in groups:
            g.shutdown()
        shared.close()


def test_a_rebuilt_mirror_equals_redis_and_the_groups(two_groups, redis_server, ns):
    """A router's mirror discarded (closed) while the groups go on, and a new one built: within
    MIRROR_BOUND_S it answers what Redis and the groups' block managers hold."""
    groups, _, shared, docs, chains = two_groups
    held = {g.group_id: tiers_of(g) for g in groups}
    assert all(t[HOST] for t in held.values())
    within(LIVE_BOUND_S, lambda: exact(shared, held, chains))
    first = MirroredPrefixIndex(RedisPrefixIndex.from_url(redis_server.url, ns, "m"))
    within(MIRROR_BOUND_S, lambda: exact(first, held, chains))
    first.close()
    visit(groups[0], [docs[5] + [9], docs[4] + [8]])  # the groups change while no mirror runs
    held = {g.group_id: tiers_of(g) for g in groups}
    rebuilt = MirroredPrefixIndex(RedisPrefixIndex.from_url(redis_server.url, ns, "m"))
    try:
        took = within(MIRROR_BOUND_S + LIVE_BOUND_S, lambda: exact(rebuilt, held, chains))
        print(f"rebuilt mirror exact after {took:.2f} s")
        assert exact(shared, held, chains)
        for c in chains:
            assert {g: answered(m) for g, m in rebuilt.match(c).items()} == {
                g: answered(m) for g, m in shared.match(c).items()
            }
    finally:
        rebuilt.close()


@pytest.mark.parametrize("down_s", [1.0, 4.0], ids=["short", "past-ttl"])
def test_redis_restarted_empty_is_republished_and_nothing_gone_is_predicted_meanwhile(
    two_groups, redis_server, ns, down_s
):
    """Redis killed while the groups serve and evict; during the outage a router (its mirror
    over Redis, failing over to this process's index) predicts only blocks the groups hold, or
    nothing; Redis started again, empty, on the same port, and a group serving at once (its
    events racing its republish): within republish_bound_s the index in Redis and in the mirror
    equals the groups' block managers."""
    groups, memory, shared, docs, chains = two_groups
    mirror = MirroredPrefixIndex(RedisPrefixIndex.from_url(redis_server.url, ns, "m"))
    router = FailoverReader(mirror, memory)
    try:
        held = {g.group_id: tiers_of(g) for g in groups}
        within(LIVE_BOUND_S, lambda: exact(mirror, held, chains))
        redis_server.stop()
        down_at = time.monotonic()
        visit(groups[0], [docs[0] + [9], docs[1] + [8], docs[5] + [4]])  # evictions Redis never hears of
        visit(groups[1], [docs[0] + [3]])
        before, held = held, {g.group_id: tiers_of(g) for g in groups}
        assert any(union(before[g]) - union(held[g]) for g in held), "the visits should evict blocks"
        for c in chains:
            got = router.match(c)
            assert {g: answered(got.get(g)) for g in held} == {g: walked(t, c) for g, t in held.items()}
            try:
                stale = mirror.match(c)
            except IndexUnavailableError:
                continue
            for g, t in held.items():  # a stale copy may answer only blocks still held, in any tier
                assert sum(answered(stale.get(g))) <= sum(walked(t, c)), (g, answered(stale.get(g)), walked(t, c))
        time.sleep(max(0.0, down_s - (time.monotonic() - down_at)))
        outage = time.monotonic() - down_at
        redis_server.start()
        back_at, bound = time.monotonic(), republish_bound_s(outage)
        visit(groups[1], [docs[1] + [2], docs[5] + [1], docs[2] + [6]])  # at once, racing the republish
        held = {g.group_id: tiers_of(g) for g in groups}
        within(
            bound - (time.monotonic() - back_at), lambda: exact(shared, held, chains) and exact(mirror, held, chains)
        )
        took = time.monotonic() - back_at
        print(f"Redis down {outage:.2f} s; index exact {took:.2f} s after it was back (bound {bound:.1f} s)")
        for c in chains:
            assert {g: answered(router.match(c).get(g)) for g in held} == {g: walked(t, c) for g, t in held.items()}
    finally:
        mirror.close()
