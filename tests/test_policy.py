"""Placement policies on real block hashes, index answers and group statuses."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest

from cluster.cost_model import CostModel
from cluster.group import GroupStatus
from cluster.index import GroupMatch, InMemoryPrefixIndex, Matches, RedisPrefixIndex
from router.placement import Ledger, PendingPlacements, PrefixAware, PrefixAwareConfig, make_policy
from tests.redis_server import RedisServer
from worker.hashing import BlockHasher, ModelFingerprint

HASHER = BlockHasher(b"policy-secret", ModelFingerprint("m", block_size=16))
# a restore from the host at 1.6% of a block's recompute, a disk read at 1e-4 s (benchmarks/RESULTS.md)
TIER_COSTS = CostModel(load_block_s=1.3e-5, fetch_block_s=1e-4)


class Placer:
    """A policy with the ledger a router keeps for it: each choice is recorded as `Router.place`
    records it (`formula`: choose by the plain formula, not the fast loop)."""

    def __init__(self, policy, formula: bool = False) -> None:
        self.policy = policy
        self.ledger = Ledger(InMemoryPrefixIndex(), policy.block_size, policy.placed_window())
        self._choose = policy.choose_by_formula if formula else policy.choose

    @property
    def placed(self):
        return self.ledger.placed

    def choose(self, block_hashes, statuses, matches):
        p = self._choose(block_hashes, statuses, matches, self.ledger.placed)
        self.ledger.record(p, block_hashes, len(statuses))
        return p


def chain(n_blocks: int, first: int = 0) -> list[bytes]:
    return HASHER.hash_prompt(list(range(first, first + 16 * n_blocks)))


def status(gid: str, queued: int = 0, running: int = 0, free: int = 1000, cached: int = 0, waiting: int = 0):
    return GroupStatus(
        gid,
        True,
        1,
        ("cpu",),
        blocks_total=1000,
        blocks_free=free,
        blocks_cached=cached,
        running=running,
        waiting=waiting,
        pending_prefill_tokens=queued,
    )


def match(gid: str, blocks: int = 0, pending: int = 0) -> GroupMatch:
    return GroupMatch(gid, 1, blocks, pending)


def test_prefers_the_holder_and_counts_pending_blocks():
    policy = Placer(make_policy("prefix_aware"))
    c = chain(100)
    statuses = {g: status(g) for g in ("a", "b", "c")}
    p = policy.choose(c, statuses, {"a": match("a"), "b": match("b", 80), "c": match("c")})
    assert (p.group_id, p.reason, p.cached_blocks) == ("b", "prefix_hit", 80)
    p = policy.choose(c, statuses, {"a": match("a"), "b": match("b"), "c": match("c", 0, 100)})
    assert p.group_id == "c"  # a placement just made elsewhere counts


def test_spills_when_the_holders_queue_costs_more_than_a_prefill_elsewhere():
    policy = Placer(make_policy("prefix_aware"))
    c = chain(100)  # 1600 tokens
    matches = {"a": match("a", 100), "b": match("b")}
    light = {"a": status("a", queued=500), "b": status("b")}
    assert policy.choose(c, light, matches).group_id == "a"
    heavy = {"a": status("a", queued=20_000, running=50), "b": status("b")}
    p = policy.choose(c, heavy, matches)
    assert (p.group_id, p.reason) == ("b", "spill")


def test_a_copy_elsewhere_is_charged_for_the_requests_it_delays():
    """The same holder's queue (0.3 s) is worth a cold copy of its 1600-token prefix on an idle
    cluster, where nobody waits behind the copy, and not on a busy one, where every group has
    ten requests that would wait behind it."""
    c = chain(100)
    matches = {g: match(g, 100 if g == "a" else 0) for g in "abcd"}
    for formula in (False, True):
        idle = {"a": status("a", queued=6000, running=2), **{g: status(g) for g in "bcd"}}
        p = Placer(make_policy("prefix_aware"), formula).choose(c, idle, matches)
        assert (p.group_id, p.reason) in {("b", "spill"), ("c", "spill"), ("d", "spill")}
        busy = {"a": status("a", queued=6000, running=10), **{g: status(g, running=8, waiting=2) for g in "bcd"}}
        p = Placer(make_policy("prefix_aware"), formula).choose(c, busy, matches)
        assert (p.group_id, p.reason) == ("a", "prefix_hit")


def test_the_choice_follows_a_groups_new_status():
    # The policy keeps the terms that only a status sets between decisions; a group that
    # reports again (a new status object) must be scored on the new one.
    policy = Placer(make_policy("prefix_aware"))
    c = chain(50)
    matches = {g: match(g) for g in "ab"}
    statuses = {"a": status("a", queued=20_000, running=50), "b": status("b")}
    assert policy.choose(c, statuses, matches).group_id == "b"
    statuses = {"a": status("a"), "b": status("b", queued=5_000)}
    assert policy.choose(c, statuses, matches).group_id == "a"
    statuses["a"] = status("a", queued=20_000, running=50)  # only a reports; b's is the same
    assert policy.choose(c, statuses, matches).group_id == "b"


def test_replication_is_bounded_by_max_replicas():
    policy = Placer(PrefixAware(PrefixAwareConfig(max_replicas=2)))
    c = chain(100)
    statuses = {g: status(g, queued=50_000 if g in "ab" else 0) for g in "abcd"}
    matches = {g: match(g, 100 if g in "ab" else 0) for g in "abcd"}
    assert policy.choose(c, statuses, matches).group_id in ("a", "b")  # two holders: cap hit
    matches["b"] = match("b")
    assert policy.choose(c, statuses, matches).group_id in ("c", "d")  # one holder: spill


def test_new_prefixes_spread_and_a_full_cache_is_avoided():
    policy = Placer(make_policy("prefix_aware"))
    statuses = {g: status(g) for g in "abcd"}
    chosen = {policy.choose(chain(20, first=7 * i), statuses, {}).group_id for i in range(40)}
    assert chosen == set("abcd")
    full = {g: status(g, free=1000, cached=1000 if g != "c" else 0) for g in "abcd"}
    assert policy.choose(chain(50), full, {}).group_id == "c"  # no eviction there


def test_prefix_hash_is_consistent_and_follows_the_first_block():
    policy = Placer(make_policy("prefix_hash"))
    statuses = {g: status(g) for g in "abcdef"}
    c = chain(10)
    first = policy.choose(c, statuses, {}).group_id
    assert all(policy.choose(c[:k], statuses, {}).group_id == first for k in range(1, 10))
    # Removing another group never moves the prefix (rendezvous hashing).
    other = next(g for g in statuses if g != first)
    fewer = {g: s for g, s in statuses.items() if g != other}
    assert Placer(make_policy("prefix_hash")).choose(c, fewer, {}).group_id == first
    spread = {policy.choose(chain(4, first=i * 64), statuses, {}).group_id for i in range(60)}
    assert len(spread) == 6


def test_unknown_policy_names_the_choices():
    with pytest.raises(ValueError, match="prefix_aware"):
        make_policy("nope")
    with pytest.raises(ValueError, match="max_replicas"):
        PrefixAwareConfig(max_replicas=0)


def test_a_hot_prefix_spreads_over_its_holders_and_spills_at_the_load_bound():
    one_bound = PrefixAwareConfig(load_slack=0.1, load_burst=2, balance_window=250, hit_slack=None)
    policy = Placer(PrefixAware(one_bound))
    statuses = {g: status(g) for g in "abcd"}
    hot = chain(100)
    holders = {"a", "b"}
    placed, reasons = [], []
    for _ in range(40):  # every request asks about the hot document; a placement caches it
        matches = {g: match(g, 100 if g in holders else 0) for g in "abcd"}
        p = policy.choose(hot, statuses, matches)
        placed.append(p.group_id)
        reasons.append(p.reason)
        holders.add(p.group_id)
    assert sorted(placed[:2]) == ["a", "b"]  # the least placed holder first
    first_spill = reasons.index("spill")
    # Holders at k placements each are over the bound once k >= 1.1 * (2k / 4) + 2, i.e. k = 5.
    assert first_spill == 10 and placed[first_spill] in "cd"
    counts = [placed.count(g) for g in "abcd"]
    assert max(counts) <= 1.1 * 10 + 2  # bounded by (1 + slack) * mean + burst
    assert reasons.count("spill") == 2  # one spill per new replica, then hits again


def loaded(counts: dict[str, int], **options) -> Placer:
    """A policy whose window holds `counts` placements per group (a window long enough that
    their decay is negligible)."""
    policy = Placer(PrefixAware(PrefixAwareConfig(load_slack=0.1, load_burst=2, balance_window=10_000, **options)))
    for g, k in counts.items():
        for _ in range(k):
            policy.placed.add(g, 0, len(counts))
    return policy


def test_a_sole_holder_over_the_bound_keeps_its_prefix_up_to_the_hit_bound():
    counts = {"a": 30, "b": 10, "c": 10, "d": 10}  # mean 15: bound 18.5, hit bound (1.0) 32
    statuses = {g: status(g) for g in "abcd"}
    doc = chain(100)
    only_a = {g: match(g, 100 if g == "a" else 0) for g in "abcd"}
    p = loaded(counts, hit_slack=1.0).choose(doc, statuses, only_a)
    assert (p.group_id, p.reason) == ("a", "prefix_hit")
    # One bound for all: the holder is over it, so the document is computed a second time.
    p = loaded(counts, hit_slack=None).choose(doc, statuses, only_a)
    assert (p.group_id, p.reason) != ("a", "prefix_hit") and p.reason == "spill"
    # Past the hit bound the holder takes nothing either.
    p = loaded({**counts, "a": 40}, hit_slack=1.0).choose(doc, statuses, only_a)
    assert p.reason == "spill"
    # A new document on equal queues: the balance term keeps it off the most placed group.
    for i in range(20):
        assert loaded(counts, hit_slack=1.0).choose(chain(30, first=5 + i), statuses, {}).group_id != "a"


def test_a_new_document_goes_where_its_prefill_starts_soonest_whatever_the_request_counts():
    """The load bound counts requests: the group that took the most lately may be the idle one
    (short questions), the others busy with long prefills. A new document costs the same
    recompute anywhere and is not bounded: it goes where its wait is shortest."""
    counts = {"a": 30, "b": 10, "c": 10, "d": 10}  # mean 15: a over the bound (18.5)
    statuses = {"a": status("a"), **{g: status(g, queued=20_000) for g in "bcd"}}
    for i in range(10):
        p = loaded(counts).choose(chain(30, first=5 + i), statuses, {})
        assert (p.group_id, p.reason) == ("a", "new_prefix")
    # a question on a document that b holds keeps the bound: b, not the idle a over it
    doc = chain(30, first=5)
    p = loaded(counts).choose(doc, statuses, {g: match(g, 30 if g == "b" else 0) for g in "abcd"})
    assert (p.group_id, p.reason) == ("b", "prefix_hit")


def test_a_prefix_with_more_holders_than_hit_holders_spills_at_the_bound():
    counts = {"a": 30, "b": 30, "c": 30, "d": 10}  # mean 25: bound 29.5, all holders over it
    statuses = {g: status(g) for g in "abcd"}
    hot = chain(100)
    three = {g: match(g, 0 if g == "d" else 100) for g in "abcd"}
    p = loaded(counts, hit_slack=1.0, hit_holders=2).choose(hot, statuses, three)
    assert (p.group_id, p.reason) == ("d", "spill")  # a hot document: its questions can move
    p = loaded(counts, hit_slack=1.0, hit_holders=3).choose(hot, statuses, three)
    assert p.group_id in "abc" and p.reason == "prefix_hit"


def test_new_content_goes_to_the_pool_that_took_in_least_lately():
    policy = Placer(make_policy("prefix_aware"))
    full = {g: status(g, free=1000, cached=1000) for g in "abcd"}  # every placement evicts
    for g, tokens in (("a", 4000), ("b", 4000), ("c", 100), ("d", 4000)):
        policy.placed.add(g, tokens)
    assert policy.choose(chain(50, first=3), full, {}).group_id == "c"  # its LRU tail is oldest


def test_a_bound_without_burst_still_places_the_first_requests():
    """With load_burst 0 the bound is 0 while nothing was placed: no group is under it, and
    the request still goes somewhere (the lowest cost), then the bound spreads the rest."""
    policy = Placer(PrefixAware(PrefixAwareConfig(load_slack=0.0, load_burst=0.0)))
    statuses = {g: status(g) for g in "abc"}
    placed = [policy.choose(chain(4, 16 * i), statuses, {}).group_id for i in range(6)]
    assert sorted(placed) == ["a", "a", "b", "b", "c", "c"]


def test_the_fast_loop_chooses_as_the_formula_does(monkeypatch):
    """`PrefixAware.choose` (constant terms hoisted, status terms cached, groups without a hit
    not scored when a hit already costs less than their floor) answers what the plain formula
    over every candidate answers (`choose_by_formula`), on the same random decisions
    (statuses, holders, pending blocks, group counts and options of every kind); and scoring
    every group as a holder changes nothing either."""
    import random

    from router.placement import prefix_aware as policy_module

    chains = {n: chain(n) for n in (0, 1, 20, 200, 300)}

    def decisions(seed: int, formula: bool = False) -> list[tuple]:
        rng = random.Random(seed)
        options = rng.choice(
            [
                {},
                {"load_slack": None},
                {"max_replicas": 1},
                {"hit_slack": None},
                {"eviction_weight": 0.0},
                {"request_weight": 0.0, "balance_weight": 0.0},
            ]
        )
        policy, gids = (
            Placer(PrefixAware(PrefixAwareConfig(cost=TIER_COSTS, **options)), formula),
            [f"g{i}" for i in range(rng.choice([1, 3, 16, 64]))],
        )
        statuses, out = {}, []
        for step in range(400):
            for g in gids if step == 0 else rng.sample(gids, min(3, len(gids))):
                statuses[g] = status(
                    g,
                    rng.choice([0, 0, 500, 20000]),
                    rng.randint(0, 9),
                    rng.choice([0, 40, 1000]),
                    rng.choice([0, 500]),
                    rng.choice([0, 0, 3, 30]),
                )
            n = rng.choice(list(chains))
            matches = {
                g: match(g, rng.randint(0, n + 2), rng.choice([0, rng.randint(0, n)]))._replace(
                    host_blocks=rng.choice([0, 0, rng.randint(0, n)]), disk_blocks=rng.choice([0, 0, rng.randint(0, n)])
                )
                for g in gids
                if rng.random() < 0.2
            }
            p = policy.choose(chains[n], statuses, matches)
            out.append((p.group_id, p.reason, p.cached_blocks))
        return out

    fast = [decisions(seed) for seed in range(12)]
    assert [decisions(seed, formula=True) for seed in range(12)] == fast
    held = policy_module._held

    def every(n, statuses, matches):  # every group a "holder" (most with 0): all are scored
        hits = held(n, statuses, matches)
        return {g: hits.get(g, 0) for g in statuses}

    monkeypatch.setattr(policy_module, "_held", every)
    assert [decisions(seed) for seed in range(12)] == fast


def test_a_prefix_restored_from_a_tier_costs_its_restore_not_its_recompute():
    """A document on g0's host tier, g1 idle and cold: g0 restores it for less than g1 computes
    it, unless the restore is dearer than the recompute; and the blocks on the host count as
    the hit that the ledger predicts cached."""
    doc = chain(200)
    statuses = {"g0": status("g0", 4000, 2), "g1": status("g1", 0, 0)}
    on_host = {"g0": match("g0", 20, 0)._replace(host_blocks=180)}
    cheap = Placer(PrefixAware(PrefixAwareConfig(cost=TIER_COSTS)))
    p = cheap.choose(doc, statuses, on_host)
    assert (p.group_id, p.reason, p.cached_blocks) == ("g0", "prefix_hit", 200)
    # the same blocks on the disk tier: a restore still, through the host
    on_disk = {"g0": match("g0", 20, 0)._replace(disk_blocks=180)}
    assert cheap.choose(doc, statuses, on_disk).group_id == "g0"
    policy = PrefixAware(PrefixAwareConfig(cost=TIER_COSTS))
    s = statuses["g0"]
    host, disk, device = (policy.cost(200, s, 200, 0, 0, 1.0, 0, r) for r in ((180, 0), (0, 180), (0, 0)))
    assert device < host < disk
    assert host - device == pytest.approx(180 * TIER_COSTS.load_block_s)
    assert disk - device == pytest.approx(180 * (TIER_COSTS.load_block_s + TIER_COSTS.fetch_block_s))
    slow = Placer(PrefixAware(PrefixAwareConfig(cost=replace(TIER_COSTS, fetch_block_s=1.0))))
    assert slow.choose(doc, statuses, on_disk).group_id == "g1"


def test_load_bound_config_is_validated():
    for field in ("load_slack", "load_burst", "balance_weight", "eviction_weight"):
        with pytest.raises(ValueError, match=field):
            PrefixAwareConfig(**{field: -1.0})
    with pytest.raises(ValueError, match="balance_window"):
        PrefixAwareConfig(balance_window=0)
    with pytest.raises(ValueError, match="hit_slack"):
        PrefixAwareConfig(hit_slack=-0.1)
    with pytest.raises(ValueError, match="hit_holders"):
        PrefixAwareConfig(hit_holders=0)


def test_a_routers_own_placements_count_at_once_and_reach_others_soon(redis_server):
    group_side, router_a, router_b = (RedisPrefixIndex.from_url(redis_server.url, "own", "m1") for _ in range(3))
    c = chain(100)
    for gid in ("g0", "g1"):
        group_side.register_group(gid)
    pending = PendingPlacements(router_a, ttl_s=30.0)
    pending.record("g1", c)
    # as if not written yet: the index touched no group
    nothing = Matches({g: GroupMatch(g, 1, 0, 0) for g in ("g0", "g1")})
    seen = pending.overlay(c, nothing)
    assert (seen["g1"].pending_blocks, seen["g0"].pending_blocks) == (100, 0)
    assert seen.touched == ["g1"] and nothing.touched == []  # what the policy reads
    assert pending.overlay(chain(5, first=9), {}) == {}
    assert pending.flush(timeout_s=5.0)
    assert router_b.match(c)["g1"].pending_blocks == 100  # the shared write, a moment later
    # Past the first 32 blocks the table keeps every 32nd, as the shared index does.
    longer = chain(110)
    assert longer[:100] == c
    assert pending.overlay(longer, nothing)["g1"].pending_blocks == 96
    assert router_b.match(longer)["g1"].pending_blocks == 96


def test_pending_writes_never_raise_and_log_one_warning(caplog):
    server = RedisServer()
    server.start()
    index = RedisPrefixIndex.from_url(server.url, "down", "m1", socket_timeout_s=0.2)
    index.register_group("g0")

    pending = PendingPlacements(index)
    server.close()  # down for good: every write after this fails
    with caplog.at_level(logging.WARNING):
        for i in range(3):
            pending.record("g0", chain(4, first=i))
            assert pending.flush(timeout_s=5.0)
    warnings = [r for r in caplog.records if "pending placements not shared" in r.getMessage()]
    assert len(warnings) == 1
    m = pending.overlay(chain(4, first=2), {"g0": GroupMatch("g0", 1, 0, 0)})
    assert m["g0"].pending_blocks == 4  # the local table still has it


def test_queued_work_leaves_out_the_prefix_a_waiting_request_will_find_cached():
    """A group counts a waiting request's whole prompt as queued work until it admits it and
    finds its prefix: three questions on a cached document, queued behind a long prefill,
    would count the document three times. The router's ledger knows what it predicted cached
    and counts only the questions (and never less than what it sent uncached)."""
    from cluster.cost_model import CostModel
    from cluster.sim_group import Arrival, SimGroup, SimGroupConfig, Simulation
    from router.placement import Placement
    from worker.config import SchedulerConfig

    sched = SchedulerConfig(max_model_len=8192, max_num_batched_tokens=256)
    g = SimGroup("g0", SimGroupConfig(512, 16, sched, CostModel()), HASHER)
    doc = list(range(1000, 1000 + 640))  # 40 blocks
    Simulation([g], HASHER).run([Arrival("doc", 0.0, doc + [7] * 8, 1)], lambda a, h: g)
    ledger = Ledger(InMemoryPrefixIndex(), 16)
    # a long prompt from another router: this one's ledger knows nothing of it
    g.submit("long", list(range(2000)), 1, 1.0, HASHER.hash_prompt(list(range(2000))))
    for i in range(3):
        prompt = doc + [i] * 24  # 664 tokens: 41 whole blocks, the document's 40 cached
        p = Placement("g0", "prefix_hit", 40)
        hits = p.cached_tokens(len(prompt), 16)
        assert hits == 640 == g.scheduler.bm.match_prefix(_request(prompt)).num_tokens
        g.submit(f"q{i}", prompt, 1, 1.0, HASHER.hash_prompt(prompt))
        ledger.add_in_flight("g0", len(prompt) - hits, hits)
    g.start_step(1.0)  # admits the long prompt's first chunk; the questions wait
    reported = g.status().pending_prefill_tokens
    assert reported == 2000 - 256 + 3 * 664
    seen = ledger.with_in_flight({"g0": g.status()})["g0"].pending_prefill_tokens
    assert seen == reported - 3 * 640 == 2000 - 256 + 3 * 24
    # What it sent uncached is the floor while the group's report lags behind.
    lagging = replace(g.status(), pending_prefill_tokens=0)
    assert ledger.with_in_flight({"g0": lagging})["g0"].pending_prefill_tokens == 3 * 24
    for _ in range(3):  # their first tokens: nothing of theirs is in flight any more
        ledger.add_in_flight("g0", -24, -640)
    assert ledger.in_flight == {}
    assert ledger.with_in_flight({"g0": g.status()})["g0"].pending_prefill_tokens == reported


def _request(prompt: list[int]):
    from worker.engine.request import Request
    from worker.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=1)
    return Request("probe", prompt, params, max_tokens=1, block_hashes=HASHER.hash_prompt(prompt))


def test_a_prediction_stops_before_the_block_of_the_last_token():
    """An exact repeat of a block-aligned prompt: the engine computes its last token, so its
    last block is not a hit; the prediction says the same."""
    from router.placement import Placement

    assert Placement("g", "prefix_hit", 4).cached_tokens(64, 16) == 48
    assert Placement("g", "prefix_hit", 4).cached_tokens(65, 16) == 64
    assert Placement("g", "prefix_hit", 2).cached_tokens(64, 16) == 32
    assert Placement("g", "new_prefix", 0).cached_tokens(1, 16) == 0


def test_the_index_per_tier_match_leads_a_revisit_to_the_host_that_holds_it():
    """Real KV events into the in-process index: a document evicted from g0's pool to its host
    tier still draws its questions to g0 (restored, not recomputed on idle g1), and once the host
    drops it too the hit is only what the device keeps."""
    from worker.kv_events import HOST, BlockRemoved, BlockStored

    index, doc = InMemoryPrefixIndex(), chain(200)
    e0, e1 = index.register_group("g0"), index.register_group("g1")
    index.publish("g1", e1, [])
    index.publish("g0", e0, [BlockStored(tuple(doc), None)])
    index.publish("g0", e0, [BlockRemoved(tuple(doc[20:])), BlockStored(tuple(doc[20:]), None, HOST)])
    policy = PrefixAware(PrefixAwareConfig(cost=TIER_COSTS))
    ledger = Ledger(index, 16, policy.placed_window())
    statuses = {"g0": status("g0", 4000, 2), "g1": status("g1")}
    question = chain(201)  # the document and one more block
    assert question[:200] == doc
    p = policy.choose(question, statuses, ledger.matches(question), ledger.placed)
    assert (p.group_id, p.cached_blocks) == ("g0", 200)
    index.publish("g0", e0, [BlockRemoved(tuple(doc[20:]), HOST)])
    p = policy.choose(question, statuses, ledger.matches(question), ledger.placed)
    assert p.cached_blocks == (20 if p.group_id == "g0" else 0)
