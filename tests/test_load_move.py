"""Streams moved off a loaded group with their KV: with `Router.move_for_load`, the router sees
mid-stream that another live group would finish a stream sooner (router/router.py,
`load_move_target`), has that group pull the full committed blocks of the prompt and of the
tokens generated so far, and resumes there, recomputing only the tail.

The rule alone on statuses built by hand; then in this process, two LocalGroups, the built-in
model in float32: streams running on g0 when g1 joins the router (a group added, or back from a
restart) move to it until the two are balanced, and no further (the streams of one check do not
all leave for the idle group); every stream's tokens equal an undisturbed run's, greedy and
seeded; g1 pulled blocks and recomputed only each moved stream's tail; with balanced groups
nothing moves.
"""

from __future__ import annotations

import asyncio

import pytest

import router.router as router_module
from cluster.cost_model import CostModel
from cluster.group import GroupStatus
from cluster.index import InMemoryPrefixIndex
from cluster.local_group import LocalGroup
from pagefleet.llm import engine_config
from router.launch.local import router_side
from router.router import LOAD_MOVE_MARGIN, MAX_RESUMES, RESUMES_KEPT, Router, RouteRequest, load_move_target
from worker.protocol import GenerationRequest
from worker.sampling_params import SamplingParams

SECRET = "load-move-test-secret"
PROMPT_LEN = 40  # 2 full blocks of 16, and 8 tokens
JOIN_AFTER = 8  # tokens every stream has on g0 before g1 joins
MAX_TOKENS = 64
STREAMS = 4  # on g0, half greedy and half seeded
OPTIONS = dict(num_blocks=128, max_model_len=512, cluster_secret=SECRET, kv_host_bytes=1 << 24, dtype="float32")


# ---- the rule --------------------------------------------------------------------------------


def status(gid: str, running: int, waiting: int = 0, queued: int = 0) -> GroupStatus:
    return GroupStatus(gid, True, 1, ("cpu",), 256, 256, 0, running, waiting, queued)


def target(here: GroupStatus, *others: GroupStatus, moving=(), known=100, left=200, resumes=0, pull=True):
    statuses = {s.group_id: s for s in (here, *others)}
    return load_move_target(here, statuses, set(moving), known, left, resumes, CostModel(), 16, pull)


def test_a_stream_leaves_for_the_group_where_it_finishes_soonest():
    assert target(status("g0", 8), status("g1", 0)) == "g1"
    assert target(status("g0", 8), status("g1", 5), status("g2", 1), status("g3", 3)) == "g2"
    assert target(status("g0", 8), status("g1", 0, waiting=4)) == "g1"  # waiting requests count
    # a group with a long prefill queued finishes it later: the stream waits behind it
    assert target(status("g0", 8), status("g1", 0, queued=50_000)) is None


def test_a_stream_stays_within_the_margin_or_without_tokens_to_repay_its_move():
    margin = LOAD_MOVE_MARGIN
    assert target(status("g0", 4 + margin - 1), status("g1", 4)) is None
    assert target(status("g0", 4 + margin), status("g1", 4)) == "g1"
    assert target(status("g0", 8), status("g1", 0), left=1) is None  # the stall outweighs a token
    assert target(status("g0", 8), status("g1", 0), left=0) is None
    # without a pull the whole known sequence is recomputed: a long one does not pay
    assert target(status("g0", 8), status("g1", 0), known=20_000, pull=False) is None
    assert target(status("g0", 8), status("g1", 0), known=20_000) == "g1"


def test_a_stream_keeps_resumes_for_failures_and_a_moving_group_takes_part_in_no_other_move():
    assert target(status("g0", 8), status("g1", 0), resumes=MAX_RESUMES - RESUMES_KEPT - 1) == "g1"
    assert target(status("g0", 8), status("g1", 0), resumes=MAX_RESUMES - RESUMES_KEPT) is None
    assert target(status("g0", 8), status("g1", 0), moving={"g1"}) is None  # one arriving there
    assert target(status("g0", 8), status("g1", 0), moving={"g0"}) is None  # one leaving here
    assert target(status("g0", 8), status("g1", 0), status("g2", 1), moving={"g1"}) == "g2"


# ---- in this process -------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def every_output_checks(monkeypatch):
    monkeypatch.setattr(router_module, "DRAIN_CHECK_S", 0.0)


@pytest.fixture(scope="module")
def local():
    index = InMemoryPrefixIndex()
    config = engine_config("builtin", **OPTIONS)
    g0, g1 = (LocalGroup(config, index, group_id=f"g{i}") for i in range(2))
    hasher, _, info = router_side(config, "builtin")
    reference = LocalGroup(config, group_id="ref")  # the undisturbed runs, sharing no cache
    yield g0, g1, hasher, info, index, reference
    for g in (g0, g1, reference):
        g.shutdown()


def params(i: int) -> SamplingParams:
    if i % 2:
        return SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, top_p=0.9, seed=i, ignore_eos=True)
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def prompts(k: int) -> list[list[int]]:
    """Prompts of their own for each test: no group holds any of them before."""
    return [[(11 * j + 5 + 37 * (k * STREAMS + i)) % 1000 for j in range(PROMPT_LEN)] for i in range(STREAMS)]


def undisturbed(reference: LocalGroup, ids: list[list[int]]) -> list[list[int]]:
    async def one(i: int) -> list[int]:
        request = GenerationRequest(ids[i], params(i), request_id=f"ref-{i}")
        return list([o async for o in reference.generate(request)][-1].outputs[0].token_ids)

    async def run():
        return await asyncio.gather(*(one(i) for i in range(len(ids))))

    return asyncio.run(run())


def streamed(router: Router, ids: list[list[int]], rid: str, joined=None) -> list[tuple[list[int], int]]:
    """Every stream's tokens, streamed together, and how many it had when it moved (0: it did
    not); `joined()` once each has JOIN_AFTER tokens."""
    counts, pending = [0] * len(ids), [joined] if joined is not None else []

    async def one(i: int) -> tuple[list[int], int]:
        request = RouteRequest(prompt_token_ids=ids[i], params=params(i), request_id=f"{rid}-{i}")
        tokens: list[int] = []
        moved_at = 0
        async for out in router.generate(request):
            if not moved_at and router.records[out.request_id].resumes:
                moved_at = len(tokens)
            tokens = list(out.outputs[0].token_ids)  # (the output so far)
            counts[i] = len(tokens)
            if pending and min(counts) >= JOIN_AFTER:
                pending.pop()()
        return tokens, moved_at

    async def run():
        return await asyncio.gather(*(one(i) for i in range(len(ids))))

    return asyncio.run(run())


def test_streams_move_for_load_to_a_group_that_joins_with_their_kv(local):
    g0, g1, hasher, info, index, reference = local
    router = Router([g0], index, hasher, info)
    router.move_for_load = True
    ids = prompts(0)
    before = g1.engine.engine.stats()
    results = streamed(router, ids, "load", joined=lambda: router.set_groups([g0, g1]))
    after = g1.engine.engine.stats()

    assert [tokens for tokens, _ in results] == undisturbed(reference, ids)
    records = [router.records[f"load-{i}"] for i in range(STREAMS)]
    moved = [(r, at) for r, (_, at) in zip(records, results, strict=True) if r.resumes]
    # until the two are balanced (g0 keeps at least as many), one at a time: no herd
    assert 1 <= len(moved) <= STREAMS // 2, [(r.group_id, r.resumes) for r in records]
    reused = 0  # of the pulled blocks, those g1 served from its cache
    for r, at in moved:
        assert r.resumes == 1 and r.group_id == "g1" and r.pulled_from == "g0" and at >= JOIN_AFTER
        # the prompt's blocks and the generated ones (the last token's block is computed)
        full = (PROMPT_LEN + at - 1) // 16
        assert r.pulled_blocks >= full
        reused += min(r.pulled_blocks, full)
    assert all(r.group_id == "g0" and r.pulled_blocks == 0 for r in records if not r.resumes)
    # g1 computed each moved stream's tail (all but the pulled blocks), then a token a step
    computed = after["tokens_computed"] - before["tokens_computed"]
    assert computed == len(moved) * (PROMPT_LEN + MAX_TOKENS - 1) - 16 * reused
    assert after["kv_blocks_imported"] - before["kv_blocks_imported"] == sum(r.pulled_blocks for r, _ in moved)
    assert router.ledger.moving == {} and router.ledger.in_flight == {}


def test_with_balanced_groups_nothing_moves(local):
    g0, g1, hasher, info, index, reference = local
    router = Router([g0, g1], index, hasher, info, policy="round_robin")  # two streams each
    router.move_for_load = True
    ids = prompts(1)
    results = streamed(router, ids, "balanced")

    records = [router.records[f"balanced-{i}"] for i in range(STREAMS)]
    assert sorted(r.group_id for r in records) == ["g0", "g0", "g1", "g1"]
    assert [r.resumes for r in records] == [0] * STREAMS
    assert [tokens for tokens, _ in results] == undisturbed(reference, ids)


def test_moves_for_load_are_off_unless_switched_on(local):
    g0, g1, hasher, info, index, reference = local
    router = Router([g0], index, hasher, info)
    assert router.move_for_load is False
    streamed(router, prompts(2), "off", joined=lambda: router.set_groups([g0, g1]))
    assert all(router.records[f"off-{i}"].resumes == 0 for i in range(STREAMS))
