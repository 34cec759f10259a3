"""KV pulled between groups: a question placed on a group that lacks its document is served
from the document's KV copied from the group that computed it, not recomputed.

In this process (LocalGroup: the tensors pass directly) and on the session's real two-node Ray
cluster (RayGroup, one group per node: rank r's shard through Ray's object store), with the
built-in model on CPU: the question's tokens equal the holder's own answer, the puller computes
the question's tokens only (its engine's counter and the response's cached tokens), and a pull
from a holder that is gone falls back to recompute with the same tokens.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence

import pytest

from cluster.cost_model import CostModel
from cluster.group import GroupStatus
from cluster.index import GroupMatch, InMemoryPrefixIndex
from cluster.local_group import LocalGroup
from cluster.ray.group import RayGroup, RayGroupConfig
from cluster.ray.runtime import ray
from pagefleet.llm import engine_config
from router.launch.local import router_side
from router.placement.policy import PlacedShare, Placement, Policy
from router.router import PULL_TIMEOUT_S, Router, RouteRequest, pull_pays, pull_source
from worker.kv_transfer import KVTransferError
from worker.outputs import CachedTiers
from worker.protocol import GenerationRequest
from worker.sampling_params import SamplingParams

SECRET = "kv-pull-test-secret"
DOC = [(13 * i + 7) % 1000 for i in range(160)]  # 10 blocks of 16
QUESTION = [4, 5, 6]
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
OPTIONS = dict(num_blocks=64, max_model_len=512, cluster_secret=SECRET, kv_host_bytes=1 << 24)


class Chosen(Policy):
    """Places every request on one named group: a placement that lacks the prefix."""

    name = "chosen"

    def __init__(self, group_id: str, block_size: int) -> None:
        super().__init__(block_size)
        self.group_id = group_id

    def choose(
        self,
        block_hashes: Sequence[bytes],
        statuses: Mapping[str, GroupStatus],
        matches: Mapping[str, GroupMatch],
        placed: PlacedShare,
    ) -> Placement:
        m = matches.get(self.group_id)
        # (what it holds in any tier or has pending, as prefix_aware counts a hit)
        return Placement(self.group_id, "chosen", max(m.expected_blocks, m.tier_blocks) if m is not None else 0)


def last(group, ids: list[int], rid: str, hasher):
    async def run():
        request = GenerationRequest(ids, PARAMS, request_id=rid, block_hashes=hasher.hash_prompt(ids))
        return [o async for o in group.generate(request)][-1]

    return asyncio.run(run())


def routed(router: Router, ids: list[int]):
    async def run():
        return [o async for o in router.generate(RouteRequest(prompt_token_ids=ids, params=PARAMS))][-1]

    out = asyncio.run(run())
    return out, router.records[out.request_id]


def check_pulled(router, holder, puller, stats_of, hasher) -> None:
    """The document computed on `holder`; a question routed to `puller` pulls it and computes
    the question only, with the holder's tokens."""
    first = last(holder, DOC + [1, 2, 3], "doc", hasher)
    assert first.num_cached_tokens == 0
    question = DOC + QUESTION
    before = stats_of(puller)
    out, record = routed(router, question)
    after = stats_of(puller)
    assert record.group_id == puller.group_id and record.pulled_from == holder.group_id
    assert record.pulled_blocks == len(DOC) // 16
    assert out.num_cached_tokens == record.predicted_cached_tokens == record.actual_cached_tokens == len(DOC)
    # by tier: predicted and served as pulled blocks (through the Ray group's outputs too)
    assert record.predicted_tiers == out.cached_tiers == record.actual_tiers == CachedTiers(pull=len(DOC))
    # the question's prompt tokens, then a token per decode step after the first sampled one
    assert after["tokens_computed"] - before["tokens_computed"] == len(QUESTION) + PARAMS.max_tokens - 1
    assert after["kv_blocks_imported"] - before["kv_blocks_imported"] == len(DOC) // 16
    own = last(holder, question, "own", hasher)  # the holder serving the question itself
    assert out.outputs[0].token_ids == own.outputs[0].token_ids


# ---- in this process -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def local_groups():
    index = InMemoryPrefixIndex()
    config = engine_config("builtin", **OPTIONS)
    g0 = LocalGroup(config, index, group_id="g0")
    g1 = LocalGroup(config, index, group_id="g1")
    hasher, _, info = router_side(config, "builtin")
    yield index, g0, g1, hasher, info
    g0.shutdown()
    g1.shutdown()


def test_a_question_on_a_cold_group_pulls_the_document_in_process(local_groups):
    index, g0, g1, hasher, info = local_groups
    router = Router([g0, g1], index, hasher, info, policy=Chosen("g1", info.block_size))
    check_pulled(router, g0, g1, lambda g: g.engine.engine.stats(), hasher)
    # the pulled blocks were restored onto g1's device: the index now has them there too
    assert index.match(hasher.hash_prompt(DOC))["g1"].blocks == len(DOC) // 16


def test_a_short_prefix_is_recomputed_not_pulled(local_groups):
    index, g0, g1, hasher, info = local_groups
    short = [(17 * i + 3) % 1000 for i in range(16 * 4)]
    last(g0, short + [9], "short", hasher)
    router = Router([g0, g1], index, hasher, info, policy=Chosen("g1", info.block_size))
    # the default costs: 4 blocks' prefill (3.2 ms) is sooner than a pull's 5 ms latency
    assert not pull_pays(4, router.cost, 16)
    out, record = routed(router, short + [8])
    assert record.pulled_from is None and out.num_cached_tokens == 0


FAST_LINK = CostModel(prefill_token_s=1e-4, pull_latency_s=1e-3, pull_bandwidth=1e9)
SLOW_LINK = CostModel(prefill_token_s=1e-4, pull_latency_s=1e-3, pull_bandwidth=1e6)  # 1 MB/s


def test_the_cost_model_decides_between_a_pull_and_a_recompute(local_groups):
    """The same document held by g0 and a question placed on g1: pulled when the calibrated
    link is faster than the document's prefill, recomputed when the holder's link is slow
    (24 blocks of 32 KiB at 1 MB/s: 0.79 s against 38 ms of prefill)."""
    index, g0, g1, hasher, info = local_groups
    doc = [(29 * i + 5) % 1000 for i in range(16 * 24)]
    last(g0, doc + [9], "doc2", hasher)
    slow = Router([g0, g1], index, hasher, info, policy=Chosen("g1", info.block_size))
    slow.cost = SLOW_LINK
    out, record = routed(slow, doc + [7, 7])
    assert record.pulled_from is None and out.num_cached_tokens == 0
    doc = [(31 * i + 11) % 1000 for i in range(16 * 24)]
    last(g0, doc + [9], "doc3", hasher)
    fast = Router([g0, g1], index, hasher, info, policy=Chosen("g1", info.block_size))
    fast.cost = FAST_LINK
    out, record = routed(fast, doc + [7, 7])
    assert record.pulled_from == "g0" and out.num_cached_tokens == 24 * 16


def test_a_pull_within_a_node_is_weighed_against_one_across_nodes():
    """The same blocks from two holders: the one on the puller's node, whose link the cost
    model says is faster, is pulled from; across nodes only when it alone pays."""
    from cluster.group import GroupStatus
    from cluster.index import GroupMatch
    from router.placement.policy import Placement

    def status(gid: str, node: str) -> GroupStatus:
        return GroupStatus(gid, True, 1, (f"cpu@{node}",), 100, 100, 0, 0, 0, 0)

    statuses = {"a": status("a", "n1"), "near": status("near", "n1"), "far": status("far", "n2")}
    matches = {"near": GroupMatch("near", 1, 20, 0), "far": GroupMatch("far", 1, 20, 0)}
    cost = CostModel(prefill_token_s=1e-4, pull_latency_s=1e-3, remote_pull_latency_s=0.02)
    chosen = Placement("a", "spill", 0)
    assert pull_source(chosen, matches, statuses, cost).pull_from == "near"
    assert pull_source(chosen, {"far": matches["far"]}, statuses, cost).pull_from == "far"
    # across nodes, 2 blocks' prefill (3.2 ms) does not repay the link's 20 ms
    short = {"far": GroupMatch("far", 1, 2, 0)}
    assert pull_source(chosen, short, statuses, cost).pull_from is None
    assert pull_source(chosen, short, {**statuses, "far": status("far", "n1")}, cost).pull_from == "far"


def test_a_pull_from_a_group_still_computing_the_chain_waits_for_its_step():
    """A holder indexes blocks as it schedules the step that computes them and exports between
    steps: while it still computes the chain (pending beyond its committed lead), its last
    committed blocks may be in the step in flight, and the pull's estimate adds that step."""
    from router.router import pull_eta

    cost = CostModel(step_s=1e-3, prefill_token_s=1e-4, decode_seq_s=1e-4, pull_latency_s=1e-3)
    holder = GroupStatus("b", True, 1, ("cpu",), 100, 100, 0, 2, 0, 5000)
    link = cost.pull_seconds(20)
    assert pull_eta(GroupMatch("b", 1, 20, 20), holder, None, 20, cost) == pytest.approx(link)
    step = cost.step_seconds(2048, 2)  # a step of the engine's budget (its queue is longer)
    assert pull_eta(GroupMatch("b", 1, 20, 60), holder, None, 20, cost) == pytest.approx(link + step)
    assert pull_eta(GroupMatch("b", 1, 20, 60), holder, None, 20, cost, batch_tokens=512) == pytest.approx(
        link + cost.step_seconds(512, 2)
    )
    # 30 committed blocks are worth 48 ms of prefill: pulled from a finished holder (3 ms), not
    # from one whose 0.2 s step must end first
    chosen = Placement("a", "spill", 0)
    statuses = {"a": GroupStatus("a", True, 1, ("cpu",), 100, 100, 0, 0, 0, 0), "b": holder}
    assert pull_source(chosen, {"b": GroupMatch("b", 1, 30, 30)}, statuses, cost).pull_from == "b"
    assert pull_source(chosen, {"b": GroupMatch("b", 1, 30, 90)}, statuses, cost).pull_from is None


def indexed(index, hashes, gid: str, **want) -> GroupMatch:
    """The index's match of `hashes` for `gid` once it shows `want` (fields of GroupMatch)."""
    deadline = time.monotonic() + 10
    while True:
        m = index.match(hashes)[gid]
        if all(getattr(m, k) == v for k, v in want.items()) or time.monotonic() > deadline:
            return m
        time.sleep(0.01)


def test_a_document_pulled_once_onto_the_host_tier_is_not_pulled_again(local_groups):
    """g1 has pulled a document from g0 into its host tier (the router's pull, before its
    question reached g1's device): the next question placed on g1 is a host hit and asks no
    pull (g0 exports nothing, g1 imports nothing); the one after it a device hit. Both have
    the tokens g0 gives the same questions."""
    index, g0, g1, hasher, info = local_groups
    doc = [(37 * i + 3) % 1000 for i in range(160)]
    hashes = hasher.hash_prompt(doc)
    last(g0, doc + [1, 2, 3], "doc4", hasher)
    assert asyncio.run(g1.pull_from(g0, hashes, PULL_TIMEOUT_S)) == len(hashes)
    m = indexed(index, hashes, "g1", host_blocks=len(hashes))
    assert (m.blocks, m.host_blocks) == (0, len(hashes))
    router = Router([g0, g1], index, hasher, info, policy=Chosen("g1", info.block_size))
    stats = [g.engine.engine.stats for g in (g0, g1)]
    # the first restores the pulled blocks (served as pulled, predicted on the host: the index
    # cannot tell), the second finds them on the device
    served = (CachedTiers(pull=len(doc)), CachedTiers(device=len(doc)))
    predicted = (CachedTiers(host=len(doc)), CachedTiers(device=len(doc)))
    for question, hit, tiers, guess in zip(([4, 5, 6], [7, 8, 9, 10]), (True, False), served, predicted, strict=True):
        e0, i0 = stats[0](), stats[1]()
        out, record = routed(router, doc + question)
        e1, i1 = stats[0](), stats[1]()
        assert record.group_id == "g1" and record.pulled_from is None and record.pulled_blocks == 0
        assert e1["kv_blocks_exported"] == e0["kv_blocks_exported"]  # no pull was asked
        assert i1["kv_blocks_imported"] == i0["kv_blocks_imported"]
        assert out.num_cached_tokens == record.actual_cached_tokens == len(doc)
        assert (out.cached_tiers, record.predicted_tiers) == (tiers, guess)
        assert i1["kv_host_hits"] - i0["kv_host_hits"] == (len(doc) if hit else 0)  # else a device hit
        own = last(g0, doc + question, f"own-{len(question)}", hasher)
        assert out.outputs[0].token_ids == own.outputs[0].token_ids
        indexed(index, hashes, "g1", blocks=len(hashes))


def test_concurrent_questions_on_a_cold_group_share_one_pull_of_their_document(local_groups):
    """Three questions on one document placed together on a group that lacks it: the first
    asks the pull, the others join it (the holder exports the document once), and each is
    served from the pulled blocks with the tokens the holder gives it."""
    index, g0, g1, hasher, info = local_groups
    doc = [(41 * i + 5) % 1000 for i in range(160)]
    last(g0, doc + [1, 2, 3], "doc5", hasher)
    router = Router([g0, g1], index, hasher, info, policy=Chosen("g1", info.block_size))
    exported = g0.engine.engine.stats()["kv_blocks_exported"]
    questions = [[4, 5, 6], [7, 8], [9, 10, 11, 12]]

    async def ask_all():
        async def ask(ids):
            return [o async for o in router.generate(RouteRequest(prompt_token_ids=ids, params=PARAMS))][-1]

        return await asyncio.gather(*(ask(doc + q) for q in questions))

    outs = asyncio.run(ask_all())
    assert g0.engine.engine.stats()["kv_blocks_exported"] - exported == len(doc) // 16
    for q, out in zip(questions, outs, strict=True):
        record = router.records[out.request_id]
        assert record.group_id == "g1" and record.pulled_from == "g0" and out.num_cached_tokens == len(doc)
        own = last(g0, doc + q, f"own5-{len(q)}", hasher)
        assert out.outputs[0].token_ids == own.outputs[0].token_ids
    assert router._pulls == {}  # (forgotten once done)


def test_a_pull_adds_only_the_blocks_the_chosen_group_holds_in_no_tier():
    """The chosen group's lead in any tier (device, host, disk) is what a pull must exceed;
    a holder exports its device and host lead, not its disk's."""
    cost = CostModel(prefill_token_s=1e-4, pull_latency_s=1e-3)
    chosen = Placement("a", "spill", 0)
    holder = {"b": GroupMatch("b", 1, 20, 0)}
    for own in (GroupMatch("a", 1, 0, 0, host_blocks=20), GroupMatch("a", 1, 5, 0, host_blocks=5, disk_blocks=10)):
        assert pull_source(chosen, {**holder, "a": own}, {"a", "b"}, cost).pull_from is None
    # 4 blocks held on a's host, 16 more on b: b's 20 are pulled (the import skips a's 4)
    placed = pull_source(chosen, {**holder, "a": GroupMatch("a", 1, 0, 0, host_blocks=4)}, {"a", "b"}, cost)
    assert (placed.pull_from, placed.pull_blocks) == ("b", 20)
    # a holder's host lead counts, its disk lead does not (it exports the device and the host)
    on_host = {"b": GroupMatch("b", 1, 2, 0, host_blocks=18, disk_blocks=30)}
    assert pull_source(chosen, on_host, {"a", "b"}, cost).pull_blocks == 20


def test_a_pull_from_a_stopped_holder_recomputes_with_the_same_tokens():
    config = engine_config("builtin", **OPTIONS)
    g0, g1 = LocalGroup(config, group_id="h0"), LocalGroup(config, group_id="h1")
    hasher = router_side(config, "builtin")[0]
    try:
        last(g0, DOC + [1, 2, 3], "doc", hasher)
        question = DOC + QUESTION
        own = last(g0, question, "own", hasher)
        g0.shutdown()
        pulled = asyncio.run(g1.pull_from(g0, hasher.hash_prompt(question), timeout_s=0.5))
        assert pulled == 0
        out = last(g1, question, "q", hasher)
        assert out.num_cached_tokens == 0 and out.outputs[0].token_ids == own.outputs[0].token_ids
    finally:
        g1.shutdown()


def test_blocks_of_another_format_are_refused_by_name(local_groups):
    _, g0, _, hasher, _ = local_groups
    other = LocalGroup(engine_config("builtin", **{**OPTIONS, "kv_cache_dtype": "int8"}), group_id="int8")
    try:
        chain = hasher.hash_prompt(DOC + QUESTION)
        export = g0.engine.call(lambda e: e.export_blocks(chain)).result(timeout=30)
        assert export.num_blocks == len(DOC) // 16
        with pytest.raises(KVTransferError, match="kv_cache_dtype"):
            other.engine.call(lambda e: e.import_blocks(export)).result(timeout=30)
        assert asyncio.run(other.pull_from(g0, chain, timeout_s=10)) == 0  # a pull gives up
    finally:
        other.shutdown()


# ---- on Ray: one group per node ------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_groups(ray_runtime):
    node_a, node_b = ray_runtime.node_labels
    index = InMemoryPrefixIndex()
    config = engine_config("builtin", **OPTIONS)
    groups = []
    try:
        for gid, node in (("r0", node_a), ("r1", node_b)):
            groups.append(RayGroup(config, RayGroupConfig(bundle_resources={node: 1}), group_id=gid, index=index))
        hasher, _, info = router_side(config, "builtin")
        yield index, *groups, hasher, info
    finally:
        for g in groups:
            g.shutdown()


def test_a_question_on_a_cold_group_pulls_the_document_across_nodes(ray_groups):
    index, r0, r1, hasher, info = ray_groups
    assert r0.node_ids != r1.node_ids
    router = Router([r0, r1], index, hasher, info, policy=Chosen("r1", info.block_size))
    # the document's 10 blocks repay a pull across nodes when the link's latency is 5 ms (at the
    # stated default of 20 ms their 8 ms of prefill would not)
    router.cost = CostModel(remote_pull_latency_s=5e-3)
    check_pulled(router, r0, r1, lambda g: g.engine_stats(), hasher)


def test_the_link_across_nodes_is_fitted_from_pulls_timed_between_the_nodes(ray_groups):
    """`benchmarks/routing.py --calibrate`'s link across nodes: pulls of two sizes between the
    two Ray nodes, each bringing every block (or the calibration raises), fitted to a latency
    and a bandwidth that a cost model takes for the link across nodes."""
    from benchmarks.routing import link_samples

    _, r0, r1, hasher, info = ray_groups
    stats = r0.engine_stats()
    block_bytes = int(stats["block_size"] * stats["kv_bytes_per_token"])
    samples = link_samples(r0, r1, hasher, block_bytes, sizes=(2, 12), repeats=2, seed=7)
    assert [b for b, _ in samples] == [2 * block_bytes, 12 * block_bytes] * 2
    latency, bandwidth = CostModel.fit_link(samples)
    assert latency >= 0 and 0 < bandwidth < float("inf")
    cost = CostModel(remote_pull_latency_s=latency, remote_pull_bandwidth=bandwidth, block_bytes=block_bytes)
    assert cost.pull_seconds(12, same_node=False) >= cost.pull_seconds(2, same_node=False) > 0


def test_a_pull_from_a_dead_ray_holder_recomputes_with_the_same_tokens(ray_groups):
    _, r0, r1, hasher, _ = ray_groups
    doc = [(19 * i + 1) % 1000 for i in range(160)]
    question = doc + QUESTION
    last(r0, doc + [1, 2, 3], "doc2", hasher)
    own = last(r0, question, "own2", hasher)
    ray.kill(r0.ranks_owned.rank0)
    pulled = asyncio.run(r1.pull_from(r0, hasher.hash_prompt(question), timeout_s=5))
    assert pulled == 0
    out = last(r1, question, "q2", hasher)
    assert out.num_cached_tokens == 0 and out.outputs[0].token_ids == own.outputs[0].token_ids


# ---- the block manager's side ----------------------------------------------------------------


def test_an_import_takes_host_slots_for_the_blocks_held_nowhere_and_stores_them_on_the_host():
    from factories import make_hasher, make_request

    from worker.engine.block_manager import BlockManager
    from worker.engine.tier_index import TierIndex
    from worker.kv_events import HOST, BlockRemoved, BlockStored

    events: list = []
    bm = BlockManager(8, 4, make_hasher(4), events.append, TierIndex(3, HOST))
    held = make_request(list(range(9)))  # 2 full blocks, cached on the device
    match = bm.match_prefix(held)
    bm.allocate(held, match, held.num_tokens)
    chain = [*held.block_hashes[:2], b"c" * 16, b"d" * 16, b"e" * 16, b"f" * 16]
    assert bm.held_chain(chain) == [(True, 0), (True, 1)]  # the device's, up to the first miss
    rows, early = bm.host_slots_for(chain)
    assert [i for i, _, _ in rows] == [2, 3, 4]  # the device's blocks skipped; 3 host slots
    assert not early  # (no disk tier: nothing to write first)
    bm.imported(rows, ok=True)
    assert [e.block_hashes for e in events if isinstance(e, BlockStored) and e.medium == HOST] == [tuple(chain[2:5])]
    assert [kind for kind, _ in bm.held_chain(chain)] == [True, True, False, False, False]
    bm.take_moves()  # (the step is handed over: the slots may be reused)
    rows, _ = bm.host_slots_for(chain)  # the last block takes the least recently used slot
    assert [i for i, _, _ in rows] == [5]
    assert [e.block_hashes for e in events if isinstance(e, BlockRemoved) and e.medium == HOST] == [(chain[2],)]
    bm.imported(rows, ok=False)  # a rank could not write it: the slot is free again, nothing stored
    assert chain[5] not in bm.host and bm.blocks_imported == 3
