"""KV quotas on the tiers under the device pool: a tenant's blocks in the host (or disk) tier
count against its quota there, a put for room takes the least recently used block of the
tenant furthest over its quota, and a tenant under its quota keeps its evicted documents on
the host against another tenant's flood, so that its next question restores them instead of
recomputing. The tier index alone, the block manager over it, and the engine on the built-in
model (restored tokens identical to an untiered run)."""

from __future__ import annotations

import pytest
from factories import make_hasher, make_request

from pagefleet.llm import LLM
from worker.engine.block_manager import BlockManager
from worker.engine.tier_index import TierIndex
from worker.kv_events import HOST, BlockRemoved
from worker.sampling_params import SamplingParams

BS = 4
DOC_BLOCKS = 4


def h(tenant: str, i: int) -> bytes:
    return f"{tenant}{i:04d}".encode().ljust(16, b"_")


def test_a_put_for_room_takes_the_lru_block_of_the_tenant_furthest_over_its_quota():
    tier = TierIndex(6, HOST, {"A": 2, "B": 3})
    for i in range(3):
        tier.put(h("B", i), "B")
    for i in range(3):
        tier.put(h("A", i), "A")  # full: A 1 over, B at its quota
    tier.unpin_all()
    tier.touch(h("A", 0))  # A's LRU is now its block 1
    slot, victim = tier.put(h("A", 3), "A")
    assert victim == h("A", 1) and tier.victim_tenant == "A" and tier.get(h("A", 3)) == slot
    assert tier.tenant_blocks() == {"A": 3, "B": 3}
    tier.unpin_all()
    tier.pin(tier.get(h("A", 2)))  # A's LRU is in use this step: its next one goes
    assert tier.put(h("C", 0), "C")[1] == h("A", 0)  # (C has no quota: A is still furthest over)
    assert tier.evictions_caused == {"A": 1, "C": 1} and tier.evictions_suffered == {"A": 2}
    tier.unpin_all()
    for i in range(3):  # A and B are at their quotas, C (none) over: C's flood takes its own
        tier.put(h("C", i + 1), "C")
        tier.unpin_all()
    assert tier.tenant_blocks() == {"A": 2, "B": 3, "C": 1} and tier.evictions_suffered["C"] == 3
    tier.pin(tier.get(h("C", 3)))  # C's one block in use: then the tie at quota, in put order
    assert tier.put(h("C", 4), "C")[1] == h("B", 0)
    assert tier.drop(h("B", 1)) is not None and tier.tenant_blocks()["B"] == 1
    tier.clear()
    assert tier.tenant_blocks() == {} and len(tier) == 0


def test_without_quotas_a_put_takes_the_tiers_lru_whoever_owns_it():
    tier = TierIndex(2, HOST)
    tier.put(h("B", 0), "B")
    tier.put(h("A", 0), "A")
    tier.unpin_all()
    assert tier.put(h("A", 1), "A")[1] == h("B", 0)
    assert tier.tenant_blocks() == {} and tier.evictions_caused == {}


def doc(tenant: str, n: int):
    base = (1 if tenant == "B" else 2) * 1_000_000 + n * 100
    req = make_request(list(range(base, base + DOC_BLOCKS * BS)) + [7])
    req.tenant = tenant
    return req


def run(bm: BlockManager, req) -> tuple[int, int]:
    """Admit the request with its prefix (device and host), compute it, free it: (device
    blocks matched, host blocks restored)."""
    match = bm.match_prefix(req)
    n = req.num_tokens - match.num_tokens
    assert bm.can_allocate(req, match, n)
    bm.allocate(req, match, n)
    req.num_computed_tokens = req.num_tokens
    bm.free(req)
    bm.take_moves()
    return len(match.blocks), len(match.loads)


def flood(host_quotas):
    """B caches 2 documents on a pool of 12 blocks over a host tier of 12 slots; A runs 12
    documents (48 blocks: the whole host 4 times over); returns what B's revisits restore."""
    events: list = []
    host = TierIndex(12, HOST, host_quotas)
    bm = BlockManager(12, BS, make_hasher(BS), events.append, host)
    b_docs = [doc("B", j) for j in range(2)]
    for d in b_docs:
        assert run(bm, d) == (0, 0)
    for i in range(12):
        run(bm, doc("A", i))
    b_hashes = {x for d in b_docs for x in d.block_hashes}
    assert len(b_hashes) == 2 * DOC_BLOCKS
    lost = {x for e in events if isinstance(e, BlockRemoved) and e.medium == HOST for x in e.block_hashes}
    return [run(bm, doc("B", j)) for j in range(2)], lost & b_hashes, host


def test_a_tenant_under_its_host_quota_keeps_its_documents_on_the_host_against_a_flood():
    revisits, lost, host = flood({"A": 4, "B": 8})
    assert revisits == [(0, DOC_BLOCKS), (0, DOC_BLOCKS)]  # restored whole from the host
    assert not lost
    assert host.evictions_suffered.get("B", 0) == 0 and host.evictions_caused["A"] > 0
    assert host.evictions_suffered["A"] == host.evictions_caused["A"]  # A's flood took A's own


def test_without_host_quotas_the_same_flood_pushes_the_other_tenant_off_the_host():
    revisits, lost, _ = flood(None)
    assert lost and revisits != [(0, DOC_BLOCKS), (0, DOC_BLOCKS)]


# ---- the engine ----------------------------------------------------------------------------

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
SMALL = dict(dtype="float32", block_size=8, num_blocks=24, max_model_len=128, watermark=0.0)


def docs(tenant: str, n: int) -> list[list[int]]:
    base = 20 if tenant == "B" else 500
    return [[(base + 7 * i + 31 * k) % 900 + 20 for i in range(80)] for k in range(n)]


def engine_flood(quotas: dict | None):
    """B's document, then 6 of A's (each 10 full blocks: the host of 24 slots 2.5 times over),
    then B's document again, on one engine; returns B's two outputs and the engine's stats."""
    options = {**SMALL, "kv_host_bytes": 24 * 8 * 4096, "cluster_secret": "tier-quotas"}
    if quotas is not None:
        options["tenant_kv_host_quotas"] = quotas
    llm = LLM("builtin", **options)
    engine = llm.engine

    def ask(prompt, tenant):
        rid = engine.add_request(prompt, GREEDY, tenant=tenant)
        while engine.has_unfinished():
            for out in engine.step():
                if out.request_id == rid and out.finished:
                    got = out
        return got

    b = docs("B", 1)[0]
    first = ask(b + [5], "B")
    for a in docs("A", 6):
        ask(a + [5], "A")
    again = ask(b + [9], "B")
    stats = engine.stats()
    llm.shutdown()
    return first, again, stats


@pytest.fixture(scope="module")
def untiered_tokens():
    llm = LLM("builtin", **{**SMALL, "num_blocks": 200})
    b = docs("B", 1)[0]
    outs = llm.generate([{"prompt_token_ids": b + [5]}, {"prompt_token_ids": b + [9]}], GREEDY)
    llm.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs]


def test_an_engine_restores_the_quota_keeping_tenants_document_from_the_host(untiered_tokens):
    first, again, stats = engine_flood({"A": 0.25, "B": 0.5})
    assert again.num_cached_tokens == 80 and stats["kv_host_hits"] == 80
    assert [list(first.token_ids), list(again.token_ids)] == untiered_tokens
    assert stats["tenant_kv_host_evictions_suffered"].get("B", 0) == 0
    assert stats["tenant_kv_host_blocks"]["B"] == 10
    _, lru_again, lru_stats = engine_flood(None)  # the same flood with the tier's global LRU
    assert lru_again.num_cached_tokens == 0 and lru_stats["kv_host_hits"] == 0
    assert "tenant_kv_host_blocks" not in lru_stats
    assert list(lru_again.token_ids) == untiered_tokens[1]


def test_tier_quotas_are_configured_per_tenant_and_checked_naming_tenant_and_field():
    from router.launch.build import engine_config
    from router.launch.config import ServeConfig

    tenants = {"A": {"kv_quota": 0.25, "kv_host_quota": 0.5}, "B": {"kv_disk_quota": "1MiB"}}
    engine = engine_config(ServeConfig.from_mapping({"model": "builtin", "tenants": tenants}), "secret")
    assert engine.cache.tenant_kv_quotas == {"A": 0.25}
    assert engine.cache.tenant_kv_host_quotas == {"A": 0.5}
    assert engine.cache.tenant_kv_disk_quotas == {"B": 1 << 20}
    for field in ("kv_host_quota", "kv_disk_quota"):
        for bad in (0, 1.5, -0.1, "lots"):
            with pytest.raises(ValueError, match=rf"tenants\.A\.{field}"):
                ServeConfig.from_mapping({"tenants": {"A": {field: bad}}})


def test_a_groups_tier_quotas_reach_its_prometheus_series():
    """The per-tenant host-tier figures of a real group's status, as a scrape reads them."""
    import asyncio

    from cluster.index import InMemoryPrefixIndex
    from cluster.local_group import LocalGroup
    from pagefleet.llm import engine_config
    from router.door.cluster_metrics import GroupCollector
    from router.router import ModelInfo, Router, RouteRequest

    options = {**SMALL, "kv_host_bytes": 24 * 8 * 4096, "tenant_kv_host_quotas": {"A": 0.25, "B": 0.5}}
    index = InMemoryPrefixIndex()
    group = LocalGroup(engine_config("builtin", cluster_secret="tier-quotas", **options), index, group_id="q0")

    async def flood() -> None:
        router = Router([group], index, group.hasher, ModelInfo("builtin", 128, 8, "auto", 1000))
        for tenant, prompt in [("B", docs("B", 1)[0])] + [("A", d) for d in docs("A", 6)]:
            req = RouteRequest(prompt_token_ids=prompt + [5], params=GREEDY, tenant=tenant)
            [_ async for _ in router.generate(req)]

    try:
        asyncio.run(flood())
        series = {
            (s.name, s.labels["tenant"], s.labels["tier"]): s.value
            for family in GroupCollector("builtin", lambda: [group.status()]).collect()
            if family.name.startswith("pagefleet:tenant_kv_tier")
            for s in family.samples
        }
    finally:
        group.shutdown()
    assert series[("pagefleet:tenant_kv_tier_blocks", "B", "host")] == 10
    assert series[("pagefleet:tenant_kv_tier_bytes", "B", "host")] == 10 * 8 * 4096
    assert series[("pagefleet:tenant_kv_tier_evictions_suffered_total", "A", "host")] > 0
    assert series.get(("pagefleet:tenant_kv_tier_evictions_suffered_total", "B", "host"), 0) == 0
