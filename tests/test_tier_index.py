"""The prefix index per tier: every group's blocks on its device, host and disk tiers, as its
KV events name them, in the in-process index, in Redis (a real redis-server) and in a router's
mirror of it. The same event streams fed to all three give the same per-tier inventory and the
same matches, equal to a block-by-block walk of the chain over the tiers; an engine with a host
and a disk tier publishes an inventory equal to its block manager's."""

from __future__ import annotations

import asyncio
import random
import uuid

import pytest
from factories import wait_until

from cluster.index import (
    IndexPublisher,
    InMemoryPrefixIndex,
    MirroredPrefixIndex,
    RedisPrefixIndex,
)
from cluster.index.types import GroupMatch
from cluster.local_group import LocalGroup
from pagefleet.llm import LLM, engine_config
from worker.hashing import BlockHasher, ModelFingerprint
from worker.kv_events import DEVICE, DISK, HOST, MEDIUMS, AllBlocksCleared, BlockRemoved, BlockStored
from worker.model.builtin_model import make_model_dir
from worker.protocol import GenerationRequest
from worker.sampling_params import SamplingParams

HASHER = BlockHasher(b"tier-index-secret", ModelFingerprint("tiny", block_size=2))


def chain(n: int, doc: int) -> list[bytes]:
    return HASHER.hash_prompt([doc] + list(range(2 * n - 1)))


@pytest.fixture
def backends(redis_server):
    """(writers, readers): the in-process index and Redis take the events; both and a mirror
    of Redis answer."""
    ns = f"t{uuid.uuid4().hex[:8]}"
    memory, shared = InMemoryPrefixIndex(), RedisPrefixIndex.from_url(redis_server.url, ns, "m")
    mirror = MirroredPrefixIndex(RedisPrefixIndex.from_url(redis_server.url, ns, "m"))
    yield (memory, shared), (memory, shared, mirror)
    mirror.close()
    shared.close()


def lead(chain_: list[bytes], held: set[bytes]) -> int:
    n = 0
    while n < len(chain_) and chain_[n] in held:
        n += 1
    return n


def walked(tiers: dict[str, set[bytes]], chain_: list[bytes]) -> tuple[int, int, int]:
    """(device, host, disk) blocks as the block manager follows the chain: the device's lead,
    then the blocks on the device or the host, then those in any tier."""
    d = lead(chain_, tiers[DEVICE])
    u = max(d, lead(chain_, tiers[DEVICE] | tiers[HOST]))
    return d, u - d, max(u, lead(chain_, tiers[DEVICE] | tiers[HOST] | tiers[DISK])) - u


def answered(m: GroupMatch | None) -> tuple[int, int, int]:
    return (0, 0, 0) if m is None else (m.blocks, m.host_blocks, m.disk_blocks)


def check(readers, expected: dict[str, dict[str, set[bytes]]], chains) -> None:
    """Every reader's per-tier inventory and matches are the expected ones."""
    assert readers[2].wait_synced()
    for reader in readers:
        for gid, tiers in expected.items():
            assert reader.inventory(gid) == {m: frozenset(tiers[m]) for m in MEDIUMS}, (type(reader), gid)
        for c in chains:
            got = reader.match(c)
            assert {g: answered(got.get(g)) for g in expected} == {g: walked(t, c) for g, t in expected.items()}
            assert {g for g, a in got.items() if any(answered(a))} <= set(got.touched)


def publish(writers, epochs, gid: str, events) -> None:
    for w in writers:
        w.publish(gid, epochs[w][gid], events)


def prefix_closed(tiers: dict[str, set[bytes]], docs) -> bool:
    """Whether the device, device + host and every tier each hold a prefix of every chain, as a
    block manager keeps them (a request frees its blocks tail first; a tier takes what the one
    above evicts): what counting by probes relies on."""
    unions = (tiers[DEVICE], tiers[DEVICE] | tiers[HOST], tiers[DEVICE] | tiers[HOST] | tiers[DISK])
    return all(lead(c, u) == len(u & set(c)) for c in docs for u in unions)


@pytest.mark.parametrize("seed", [0, 1])
def test_random_tier_histories_give_each_backend_the_same_inventory_per_tier(backends, seed):
    """Random stores, removals and moves on every medium, kept where the tiers stay
    prefix-closed; chains long enough for sparse probes."""
    writers, readers = backends
    rng = random.Random(seed)
    docs = [chain(rng.randint(1, 90), d) for d in range(5)]
    gids = [f"g{i}" for i in range(3)]
    epochs = {w: {g: w.register_group(g) for g in gids} for w in writers}
    expected = {g: {m: set() for m in MEDIUMS} for g in gids}
    applied = 0
    for _ in range(600):
        g, c, medium = rng.choice(gids), rng.choice(docs), rng.choice(MEDIUMS)
        i = rng.randrange(len(c))
        part = tuple(c[i : rng.randint(i + 1, len(c))])
        op, tiers = rng.random(), {m: set(h) for m, h in expected[g].items()}
        if op < 0.45:
            events = [BlockStored(part, None, medium)]
            tiers[medium] |= set(part)
        elif op < 0.8:
            events = [BlockRemoved(part, medium)]
            tiers[medium] -= set(part)
        elif op < 0.97:  # evicted from the device to the host in one step: a removal and a store
            events = [BlockRemoved(part, DEVICE), BlockStored(part, None, HOST)]
            tiers[DEVICE] -= set(part)
            tiers[HOST] |= set(part)
        else:
            events = [AllBlocksCleared()]
            tiers = {m: set() for m in MEDIUMS}
        if not prefix_closed(tiers, docs):
            continue
        publish(writers, epochs, g, events)
        expected[g], applied = tiers, applied + 1
        if applied % 40 == 0:
            check(readers, expected, docs)
    assert applied > 100
    check(readers, expected, docs)


def test_a_long_chain_across_tiers_is_counted_by_its_probes(backends):
    """A 300-block document held prefix-closed across the tiers, as a block manager holds it:
    the head on the device, then the host, then the disk, with the boundaries between probes."""
    writers, readers = backends
    doc, other = chain(300, 1), chain(300, 2)
    epochs = {w: {g: w.register_group(g) for g in ("a", "b", "c")} for w in writers}
    layouts = {"a": (70, 150, 230), "b": (0, 101, 299), "c": (40, 40, 300)}  # device, +host, +disk ends
    expected = {}
    for g, (d, u, a) in layouts.items():
        publish(writers, epochs, g, [BlockStored(tuple(doc[:d]), None)] if d else [])
        publish(writers, epochs, g, [BlockStored(tuple(doc[d - 5 if d else 0 : u]), None, HOST)])  # host overlaps
        publish(writers, epochs, g, [BlockStored(tuple(doc[u:a]), None, DISK)] if a > u else [])
        expected[g] = {DEVICE: set(doc[:d]), HOST: set(doc[d - 5 if d else 0 : u]), DISK: set(doc[u:a])}
    check(readers, expected, [doc, other, doc[:120]])
    for reader in readers:
        assert answered(reader.match(doc)["b"]) == (0, 101, 198)
    # the host's tail demoted to the disk, then every tier of "a" gone with a new epoch
    publish(writers, epochs, "c", [BlockRemoved(tuple(doc[:40])), BlockStored(tuple(doc[:35]), None, DISK)])
    expected["c"][DEVICE] = set()
    expected["c"][DISK] |= set(doc[:35])
    check(readers, expected, [doc])


def test_deregistration_and_a_new_epoch_drop_every_tier(backends):
    writers, readers = backends
    doc = chain(20, 3)
    epochs = {w: {g: w.register_group(g) for g in ("x", "y")} for w in writers}
    for g in ("x", "y"):
        publish(writers, epochs, g, [BlockStored(tuple(doc[:5]), None), BlockStored(tuple(doc[5:]), None, HOST)])
        publish(writers, epochs, g, [BlockStored(tuple(doc[10:]), None, DISK)])
    for w in writers:
        w.deregister("x", epochs[w]["x"])
        epochs[w]["y"] = w.register_group("y", epochs[w]["y"])
    assert readers[2].wait_synced()
    nothing = {m: frozenset() for m in MEDIUMS}
    for reader in readers:
        assert reader.inventory("x") is None and reader.inventory("y") == nothing
        assert not any(any(answered(a)) for a in reader.match(doc).values())
    # the new epoch's host blocks are its own
    publish(writers, epochs, "y", [BlockStored(tuple(doc[:4]), None, HOST)])
    check(readers, {"y": {DEVICE: set(), HOST: set(doc[:4]), DISK: set()}}, [doc])


def test_a_republished_inventory_holds_every_tier(backends):
    """A publisher that registers again republishes each medium's hashes: what an index that
    lost the group (Redis restarted, the heartbeat lapsed) gets back."""
    writers, readers = backends
    doc = chain(40, 4)
    tiers = {DEVICE: doc[:10], HOST: doc[10:30], DISK: doc[30:]}
    for w in writers:
        IndexPublisher(w, "r", lambda: tiers)
    check(readers, {"r": {m: set(h) for m, h in tiers.items()}}, [doc])
    for reader in readers:
        assert answered(reader.match(doc)["r"]) == (10, 20, 10)


# ---- an engine with tiers publishes --------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("tier-index"), seed=1)


async def _visit(group: LocalGroup, prompt: list[int]) -> None:
    async for _ in group.generate(GenerationRequest(prompt, SamplingParams(temperature=0.0, max_tokens=2))):
        pass


def test_an_engine_with_host_and_disk_tiers_publishes_its_inventory_per_tier(model_dir, redis_server, tmp_path):
    """A group whose pool holds two of four documents, over a host tier of one document and a
    disk tier: after every visit the index's per-tier inventory (in process, in Redis, in a
    mirror) is the engine's block manager's, and a fresh registration republishes it whole."""
    ns = f"e{uuid.uuid4().hex[:8]}"
    memory, shared = InMemoryPrefixIndex(), RedisPrefixIndex.from_url(redis_server.url, ns, "m")
    mirror = MirroredPrefixIndex(RedisPrefixIndex.from_url(redis_server.url, ns, "m"))
    opts = dict(dtype="float32", block_size=8, num_blocks=24, max_model_len=128, watermark=0.0)
    stats = LLM(str(model_dir), **{**opts, "num_blocks": 16}).engine.stats()
    block_bytes = stats["kv_bytes_per_token"] * stats["block_size"]
    config = engine_config(
        str(model_dir),
        kv_host_bytes=12 * block_bytes,
        kv_disk_bytes=200 * block_bytes,
        kv_disk_dir=str(tmp_path),
        **opts,
    )
    group = LocalGroup(config, [memory, shared], group_id="tiered")
    rng = random.Random(0)
    docs = [[rng.randrange(3, 256) for _ in range(80)] for _ in range(4)]
    bm = group.engine.engine.scheduler.bm

    def engine_tiers():
        return {DEVICE: frozenset(bm.cached), HOST: frozenset(bm.host.hashes()), DISK: frozenset(bm.disk.hashes())}

    try:
        for prompt in [docs[0] + [5], docs[1] + [6], docs[2] + [7], docs[3] + [8], docs[0] + [9], docs[1] + [4]]:
            asyncio.run(_visit(group, prompt))
            want = engine_tiers()
            for reader in (memory, shared, mirror):
                assert wait_until(lambda r=reader, w=want: r.inventory("tiered") == w, 5), type(reader)
        assert want[HOST] and want[DISK], "the visits should fill the lower tiers"
        for d in docs:
            c = group.hasher.hash_prompt(d)
            expected = walked({m: set(h) for m, h in want.items()}, c)
            assert answered(memory.match(c)["tiered"]) == answered(mirror.match(c)["tiered"]) == expected
            assert answered(shared.match(c)["tiered"]) == expected
        again = RedisPrefixIndex.from_url(redis_server.url, ns + "b", "m")
        IndexPublisher(again, "tiered", group.engine.engine.tier_hashes)
        assert again.inventory("tiered") == want
        again.close()
    finally:
        group.shutdown()
        mirror.close()
        shared.close()
