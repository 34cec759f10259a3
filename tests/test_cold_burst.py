"""A cold document prefilled once: questions about a document no group holds, sent together to
a two-group router, make the cluster compute the document on one group; the questions the load
bound spills onto the other wait for the first group's commit and pull the document from it
(router/router.py, `cold_source`, COLD_WAIT_S), all with the tokens of a single-group run.

In this process (two LocalGroups over one in-process index, the built-in model on CPU); the
groups' own prefill counters (`tokens_computed`) count what was computed.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from cluster.index import GroupMatch, InMemoryPrefixIndex
from cluster.local_group import LocalGroup
from pagefleet.llm import engine_config
from router.launch.local import router_side
from router.placement.policy import Placement, Policy
from router.router import COLD_MIN_BLOCKS, Router, RouteRequest, cold_source
from worker.sampling_params import SamplingParams

SECRET = "cold-burst-test-secret"
DOC_TOKENS = 2000
DOC = [(29 * i + 11) % 997 + 3 for i in range(DOC_TOKENS)]  # 125 blocks of 16
QUESTION_TOKENS = 8
QUESTIONS = 16
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
OPTIONS = dict(
    num_blocks=4 * (DOC_TOKENS // 16 + 2), max_model_len=DOC_TOKENS + 64, cluster_secret=SECRET, kv_host_bytes=1 << 27
)
OWN = QUESTION_TOKENS + PARAMS.max_tokens - 1  # a question's own prompt tokens and its decodes


class Chosen(Policy):
    """Places every request on one named group, with what the index says it holds."""

    name = "chosen"

    def __init__(self, group_id: str, block_size: int) -> None:
        super().__init__(block_size)
        self.group_id = group_id

    def choose(self, block_hashes, statuses, matches, placed) -> Placement:
        m = matches.get(self.group_id)
        return Placement(self.group_id, "chosen", m.expected_blocks if m is not None else 0)


def question(q: int) -> list[int]:
    return DOC + [3 + q] * QUESTION_TOKENS


def computed(groups) -> int:
    return sum(g.engine.engine.stats()["tokens_computed"] for g in groups)


def ask_all(router: Router, prompts: list[list[int]]) -> list:
    """Every prompt sent at once (one event loop, no wait between them); the last outputs."""

    async def one(ids: list[int]):
        return [o async for o in router.generate(RouteRequest(prompt_token_ids=ids, params=PARAMS))][-1]

    async def run():
        return await asyncio.gather(*(one(ids) for ids in prompts))

    return asyncio.run(run())


@pytest.fixture(scope="module")
def config():
    return engine_config("builtin", **OPTIONS)


@pytest.fixture(scope="module")
def single_group_answers(config):
    """Each question's tokens from one group alone, asked one after another."""
    index = InMemoryPrefixIndex()
    group = LocalGroup(config, index, group_id="single")
    hasher, _, info = router_side(config, "builtin")
    try:
        router = Router([group], index, hasher, info)
        return [ask_all(router, [question(q)])[0].outputs[0].token_ids for q in range(QUESTIONS)]
    finally:
        group.shutdown()


def test_a_burst_on_a_cold_document_computes_it_once_with_single_group_tokens(config, single_group_answers):
    index = InMemoryPrefixIndex()
    groups = [LocalGroup(config, index, group_id=f"g{i}") for i in range(2)]
    hasher, _, info = router_side(config, "builtin")
    try:
        router = Router(groups, index, hasher, info)  # the default policy, with its load bound
        before = computed(groups)
        outs = ask_all(router, [question(q) for q in range(QUESTIONS)])
        # the document once in total, each question's own tokens once each
        assert computed(groups) - before == DOC_TOKENS + QUESTIONS * OWN
        assert [o.outputs[0].token_ids for o in outs] == single_group_answers
        records = [router.records[o.request_id] for o in outs]
        on = {g.group_id: [r for r in records if r.group_id == g.group_id] for g in groups}
        assert all(on.values()), "the load bound spreads the burst over both groups"
        computing = next(gid for gid, rs in on.items() if not any(r.pulled_from for r in rs))
        (pulling,) = set(on) - {computing}
        assert all(r.pulled_from == computing for r in on[pulling])
        # one shared pull of the document's blocks, not one per question
        imported = {g.group_id: g.engine.engine.stats()["kv_blocks_imported"] for g in groups}
        assert imported == {computing: 0, pulling: DOC_TOKENS // 16}
        assert sorted(o.num_cached_tokens for o in outs) == [0] + [DOC_TOKENS] * (QUESTIONS - 1)
    finally:
        for g in groups:
            g.shutdown()


def test_a_prefix_pending_on_a_group_that_never_commits_it_is_recomputed_after_the_bound(config, single_group_answers):
    index = InMemoryPrefixIndex()
    groups = [LocalGroup(config, index, group_id=f"h{i}") for i in range(2)]
    hasher, _, info = router_side(config, "builtin")
    try:
        ids = question(0)
        # a placement on h0 (another router's, say) whose request never ran there
        index.record_pending("h0", hasher.hash_prompt(ids), ttl_s=60)
        router = Router(groups, index, hasher, info, policy=Chosen("h1", info.block_size))
        router.cold_wait_s = 0.5
        before = computed(groups)
        t0 = time.monotonic()
        (out,) = ask_all(router, [ids])
        waited = time.monotonic() - t0
        record = router.records[out.request_id]
        assert record.group_id == "h1" and record.pulled_from is None and out.num_cached_tokens == 0
        assert computed(groups) - before == DOC_TOKENS + OWN  # recomputed on h1, once
        assert out.outputs[0].token_ids == single_group_answers[0]
        assert 0.5 <= waited < 0.5 + 30  # the bound, then the recompute
    finally:
        for g in groups:
            g.shutdown()


def test_the_source_to_wait_for_is_a_group_computing_more_of_the_prefix_than_the_chosen_holds():
    def m(gid: str, blocks: int, pending: int, host: int = 0) -> GroupMatch:
        return GroupMatch(gid, 1, blocks, pending, host)

    chosen = Placement("a", "spill", 0)
    live = {"a", "b", "c"}
    # b computes 40 blocks (pending, nothing committed): wait for b and pull its 40
    got = cold_source(chosen, {"a": m("a", 0, 0), "b": m("b", 0, 40)}, live)
    assert (got.pull_from, got.pull_blocks, got.pull_wait) == ("b", 40, True)
    # of two computing groups, the one with the longer pending lead
    got = cold_source(chosen, {"b": m("b", 0, 36), "c": m("c", 2, 38)}, live)
    assert (got.pull_from, got.pull_blocks) == ("c", 38)
    # committed already (any tier): `pull_source` pulls it at once, no wait here
    assert cold_source(chosen, {"b": m("b", 30, 40, host=10)}, live).pull_from is None
    # the chosen group is computing it too (its own pending), or holds nearly as much
    assert cold_source(chosen, {"a": m("a", 0, 40), "b": m("b", 0, 40)}, live).pull_from is None
    assert cold_source(chosen, {"a": m("a", 9, 0), "b": m("b", 0, 40)}, live).pull_from is None
    # fewer than COLD_MIN_BLOCKS more: recomputed rather than waited for
    assert cold_source(chosen, {"b": m("b", 0, COLD_MIN_BLOCKS - 1)}, live).pull_from is None
    assert cold_source(chosen, {"b": m("b", 0, COLD_MIN_BLOCKS)}, live).pull_from == "b"
    # a group that is not live is never waited for
    assert cold_source(chosen, {"b": m("b", 0, 40)}, {"a"}).pull_from is None


def test_a_cold_prefix_is_waited_for_only_when_the_holder_is_sooner():
    """The cost model compares waiting for the computing group (its queued prefill, then the
    pull) with recomputing on the chosen group (its own queue, then the prefix)."""
    from cluster.cost_model import CostModel
    from cluster.group import GroupStatus

    def status(gid: str, queued: int) -> GroupStatus:
        return GroupStatus(gid, True, 1, ("cpu",), 100, 100, 0, 1, 0, queued)

    cost = CostModel(step_s=1e-3, prefill_token_s=1e-4, pull_latency_s=1e-3, pull_bandwidth=1e9)
    chosen = Placement("a", "spill", 0)
    matches = {"b": GroupMatch("b", 1, 0, 40)}  # b computes 40 blocks (640 tokens)
    # b has the prefix's 640 tokens left: 66 ms and a 2 ms pull, against 65 ms of prefill on
    # an idle a and the copy's charge (as much again)
    assert cold_source(chosen, matches, {"a": status("a", 0), "b": status("b", 640)}, cost, 16).pull_wait
    # b's queue is long (10,000 tokens, 1 s): recomputed on the idle a rather than waited for
    long_b = {"a": status("a", 0), "b": status("b", 10_000)}
    assert cold_source(chosen, matches, long_b, cost, 16).pull_from is None
    # unless a's own queue is longer still (20,000 tokens)
    busy = {"a": status("a", 20_000), "b": status("b", 10_000)}
    assert cold_source(chosen, matches, busy, cost, 16).pull_from == "b"


def test_a_prefix_under_way_waits_only_for_its_rest_and_the_step_ahead():
    """Once the holder has committed COLD_MIN_BLOCKS or more of the prefix its prefill is under
    way: what is queued behind it does not delay it, and the wait counts the prefix's rest and
    at most one step's budget of the prefills admitted before it."""
    from cluster.cost_model import CostModel
    from cluster.group import GroupStatus
    from router.router import wait_seconds

    cost = CostModel(step_s=1e-3, prefill_token_s=1e-4, pull_latency_s=1e-3, pull_bandwidth=1e9)
    holder = GroupStatus("b", True, 1, ("cpu",), 100, 100, 0, 1, 3, 10_000)
    whole = cost.step_seconds(10_000, 1) + cost.pull_seconds(100)
    assert wait_seconds(holder, 100, cost) == pytest.approx(whole)  # nothing committed: all of it
    assert wait_seconds(holder, 100, cost, committed=COLD_MIN_BLOCKS - 1) == pytest.approx(whole)
    rest = (100 - 60) * 16 + 2048  # its 40 blocks left and one step's budget ahead
    assert wait_seconds(holder, 100, cost, committed=60) == pytest.approx(
        cost.step_seconds(rest, 1) + cost.pull_seconds(100)
    )
    # so a group chosen for the prefix waits for it where the whole queue would say recompute
    chosen = Placement("a", "spill", 0)
    statuses = {"a": GroupStatus("a", True, 1, ("cpu",), 100, 100, 0, 1, 0, 0), "b": holder}
    assert cold_source(chosen, {"b": GroupMatch("b", 1, 0, 100)}, statuses, cost).pull_from is None
    got = cold_source(chosen, {"b": GroupMatch("b", 1, 60, 100)}, statuses, cost)
    assert (got.pull_from, got.pull_blocks, got.pull_wait) == ("b", 100, True)


def test_a_partial_pull_is_weighed_against_waiting_for_the_whole_prefix():
    """The lead a holder has committed can be pulled at once and the rest recomputed, or the
    whole waited for: the wait wins when it is sooner than the partial pull (after the step
    in flight, if its holder still computes) and the rest's prefill with the copy's charge,
    which grows with the requests every group holds (they wait behind a second copy's prefill
    wherever it is computed)."""
    from cluster.cost_model import CostModel
    from cluster.group import GroupStatus
    from router.router import pull_source

    cost = CostModel(step_s=1e-3, prefill_token_s=1e-4, decode_seq_s=1e-4, pull_latency_s=1e-3)

    def status(gid: str, queued: int = 0, running: int = 0) -> GroupStatus:
        return GroupStatus(gid, True, 1, ("cpu",), 100, 100, 0, running, 0, queued)

    b = GroupMatch("b", 1, 40, 100)  # b computes 100 blocks, 40 of them committed
    c = GroupMatch("c", 1, 40, 40)  # c holds those 40 and computes nothing
    chosen = Placement("a", "spill", 0)

    def place(b_queued: int, running: int = 0) -> tuple[Placement, Placement]:
        statuses = {g: status(g, b_queued if g == "b" else 0, running) for g in "abc"}
        partial = pull_source(chosen, {"b": b, "c": c}, statuses, cost)
        return partial, cold_source(partial, {"b": b, "c": c}, statuses, cost)

    # c's 40 at once (6 ms, no step to wait for), then the 60 blocks' prefill on a with the
    # copy's charge (0.19 s); or b's last 1,000 queued tokens (0.1 s) and the pull of all 100
    partial, got = place(1000)
    assert (partial.pull_from, partial.pull_blocks, partial.pull_wait) == ("c", 40, False)
    assert (got.pull_from, got.pull_blocks, got.pull_wait) == ("b", 100, True)
    # b's queue ahead of the prefix's end is 3,000 tokens (0.3 s): the partial pull is sooner
    partial, got = place(3000)
    assert got == partial
    # every group busy (4 requests at least): the rest's copy is charged 5x, and the wait wins
    _, got = place(3000, running=4)
    assert (got.pull_from, got.pull_blocks, got.pull_wait) == ("b", 100, True)


def test_a_wait_ends_at_once_when_the_computing_group_leaves(config, single_group_answers):
    index = InMemoryPrefixIndex()
    groups = [LocalGroup(config, index, group_id=f"k{i}") for i in range(2)]
    hasher, _, info = router_side(config, "builtin")
    try:
        ids = question(1)
        index.record_pending("k0", hasher.hash_prompt(ids), ttl_s=60)  # k0 "computes" it
        router = Router(groups, index, hasher, info, policy=Chosen("k1", info.block_size))
        assert router.cold_wait_s >= 30  # the bound is not what ends this wait

        async def run():
            asked = asyncio.ensure_future(_last(router.generate(RouteRequest(prompt_token_ids=ids, params=PARAMS))))
            await asyncio.sleep(0.3)
            assert not asked.done()  # waiting for k0's commit
            t0 = time.monotonic()
            router.set_groups([groups[1]])  # k0 leaves the router (retired, replaced, dead)
            out = await asked
            return out, time.monotonic() - t0

        out, after_leaving = asyncio.run(run())
        assert router.records[out.request_id].pulled_from is None and out.num_cached_tokens == 0
        assert out.outputs[0].token_ids == single_group_answers[1]
        assert after_leaving < 15  # the recompute, not the rest of the bound
    finally:
        for g in groups:
            g.shutdown()


async def _last(outputs):
    return [o async for o in outputs][-1]


class FirstThenOther(Policy):
    """The first request on `first`, every later one on `other` (with what the index says
    `other` holds): a question placed away from the group computing its document."""

    name = "first_then_other"

    def __init__(self, first: str, other: str, block_size: int) -> None:
        super().__init__(block_size)
        self.first, self.other, self.placed = first, other, 0

    def choose(self, block_hashes, statuses, matches, placed) -> Placement:
        self.placed += 1
        gid = self.first if self.placed == 1 else self.other
        m = matches.get(gid)
        return Placement(gid, "chosen", m.expected_blocks if m is not None else 0)


def test_a_wait_named_at_a_probe_position_pulls_the_whole_document(config):
    """Two questions of three blocks each on one cold document, sent together: the first is
    computed on w0; the second, on w1, finds w0's pending placement only up to the last probe
    position inside the document (block 96 of 125: pending placements are indexed at probe
    positions), waits for it, then pulls all the document's blocks that w0 committed by then
    (`_wait_and_pull`), so w1 computes its question alone."""
    asked = [DOC + [3 + q] * 40 for q in range(2)]  # 40 tokens: two full blocks past the document
    index = InMemoryPrefixIndex()
    groups = [LocalGroup(config, index, group_id=f"w{i}") for i in range(2)]
    hasher, _, info = router_side(config, "builtin")
    try:
        router = Router(groups, index, hasher, info, policy=FirstThenOther("w0", "w1", info.block_size))
        before = computed(groups)
        first, second = ask_all(router, asked)
        record = router.records[second.request_id]
        assert record.group_id == "w1" and record.pulled_from == "w0"
        assert groups[1].engine.engine.stats()["kv_blocks_imported"] == DOC_TOKENS // 16
        assert second.num_cached_tokens == DOC_TOKENS
        assert computed(groups) - before == DOC_TOKENS + 2 * (40 + PARAMS.max_tokens - 1)
    finally:
        for g in groups:
            g.shutdown()
    single_index = InMemoryPrefixIndex()
    single = LocalGroup(config, single_index, group_id="alone")
    try:
        alone = ask_all(Router([single], single_index, hasher, info), asked)
    finally:
        single.shutdown()
    assert [o.outputs[0].token_ids for o in (first, second)] == [o.outputs[0].token_ids for o in alone]
