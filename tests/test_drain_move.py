"""Streams moved off a draining group with their KV: the router sees the group's drain flag
mid-stream, has another live group pull the full committed blocks of the prompt and of the
tokens generated so far from the draining group (still alive: a drain waits for its streams),
and resumes there, recomputing only the tail.

In this process (LocalGroup) and on the session's real two-node Ray cluster (RayGroup, one
group per node, the drain flag set on rank 0 as the supervisor's `drain` does), built-in model
on CPU: the moved stream's tokens equal an undisturbed run's, greedy and seeded; blocks pulled
> 0 cover generated tokens too (decode-produced full blocks are committed to the prefix cache);
the new group's cached tokens show what it did not recompute; a pull that fails (a destination
with no host tier) or is turned off recomputes everything with the same tokens.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

import router.router as router_module
from cluster.index import InMemoryPrefixIndex
from cluster.local_group import LocalGroup
from cluster.ray.group import RayGroup, RayGroupConfig
from cluster.ray.runtime import ray
from pagefleet.llm import engine_config
from router.launch.local import router_side
from router.router import Router, RouteRequest
from worker.protocol import GenerationRequest
from worker.sampling_params import SamplingParams

SECRET = "drain-move-test-secret"
PROMPT_LEN = 40  # 2 full blocks of 16, and 8 tokens
DRAIN_AFTER = 30  # tokens streamed before the group drains: 70 known, 4 full blocks
MAX_TOKENS = 64
CASES = {
    "greedy": SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
    "seeded": SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True),
}
OPTIONS = dict(num_blocks=64, max_model_len=512, cluster_secret=SECRET, kv_host_bytes=1 << 24)


@pytest.fixture(autouse=True)
def every_output_checks_the_drain_flag(monkeypatch):
    monkeypatch.setattr(router_module, "DRAIN_CHECK_S", 0.0)


def prompt(k: int) -> list[int]:
    """A prompt of its own for each test: no group holds any of it before."""
    return [(11 * i + 5 + 37 * k) % 1000 for i in range(PROMPT_LEN)]


def undisturbed(group, ids: list[int], params: SamplingParams, rid: str) -> list[int]:
    async def run():
        return [o async for o in group.generate(GenerationRequest(ids, params, request_id=rid))][-1]

    return list(asyncio.run(run()).outputs[0].token_ids)


def moved(router: Router, ids: list[int], params: SamplingParams, rid: str, drain) -> tuple[list[int], object]:
    """The stream's tokens, the group it started on draining after DRAIN_AFTER tokens."""

    async def run():
        tokens, last = 0, None
        request = RouteRequest(prompt_token_ids=ids, params=params, request_id=rid)
        async for out in router.generate(request):
            tokens, last = len(out.outputs[0].token_ids), out  # (the output so far)
            if tokens >= DRAIN_AFTER and router.records[rid].resumes == 0:
                drain(router.records[rid].group_id)
        return last

    last = asyncio.run(run())
    return list(last.outputs[0].token_ids), router.records[rid]


def check(
    record,
    tokens: list[int],
    reference: list[int],
    start: str,
    pulled: bool,
    computed: int,
    max_tokens: int = MAX_TOKENS,
) -> None:
    """Same tokens; the destination computed the prompt and the output so far but for the
    pulled blocks, then a token per decode step (the output so far cancels out)."""
    assert tokens == reference
    assert record.resumes == 1 and record.group_id != start
    if pulled:  # the prompt's blocks and generated ones: only the tail is recomputed
        assert record.pulled_from == start and record.pulled_blocks >= (PROMPT_LEN + DRAIN_AFTER) // 16
    else:
        assert record.pulled_blocks == 0
    assert computed == PROMPT_LEN + max_tokens - 1 - 16 * record.pulled_blocks


def test_a_moved_stream_pulls_the_blocks_its_new_group_can_use():
    """The block holding the last known token is recomputed wherever the stream goes (a
    prompt's last token always is): on a block boundary the move does not pull it."""
    from types import SimpleNamespace

    from worker.hashing import BlockHasher, ModelFingerprint

    hasher = BlockHasher(SECRET.encode(), ModelFingerprint("m", block_size=16))
    router = SimpleNamespace(hasher=hasher)
    ids = prompt(99)  # 40 tokens
    for generated, blocks in ((23, 3), (24, 3), (25, 4)):  # 63, 64 and 65 tokens known
        state = SimpleNamespace(tokens=list(range(generated)))
        chain = Router._known_chain(router, ids, None, state)
        assert len(chain) == blocks
        assert chain == hasher.hash_prompt(ids + state.tokens)[:blocks]


# ---- in this process -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def local():
    index = InMemoryPrefixIndex()
    config = engine_config("builtin", **OPTIONS)
    groups = [LocalGroup(config, index, group_id=f"g{i}") for i in range(3)]
    bare = LocalGroup(engine_config("builtin", num_blocks=64, max_model_len=512), group_id="bare")
    hasher, _, info = router_side(config, "builtin")
    reference = LocalGroup(config, group_id="ref")  # an undisturbed run, sharing no cache
    yield groups, bare, hasher, info, index, reference
    for g in (*groups, bare, reference):
        g.shutdown()


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("pull", [True, False])
def test_a_drained_stream_moves_with_its_kv_in_process(local, case, pull):
    groups, _, hasher, info, index, reference = local
    for g in groups:
        g.set_draining(False)
    pair = groups[:2] if pull else groups[1:]  # (a fresh destination: nothing of it cached)
    router = Router(pair, index, hasher, info)
    router.move_pull = pull
    by_id = {g.group_id: g for g in pair}
    started = []

    def drain(gid: str) -> None:
        started.append(gid)
        by_id[gid].set_draining(True)

    rid, ids = f"{case}-{pull}", prompt(2 * sorted(CASES).index(case) + pull)
    before = {g.group_id: g.engine.engine.stats()["tokens_computed"] for g in pair}
    tokens, record = moved(router, ids, CASES[case], rid, drain)
    computed = by_id[record.group_id].engine.engine.stats()["tokens_computed"] - before[record.group_id]
    check(record, tokens, undisturbed(reference, ids, CASES[case], rid), started[0], pull, computed)


def test_a_failed_pull_recomputes_with_the_same_tokens(local):
    groups, bare, hasher, info, index, reference = local
    source = LocalGroup(engine_config("builtin", **OPTIONS), index, group_id="src")
    try:
        router = Router([source, bare], index, hasher, info)
        bare.set_draining(True)  # (until the stream is on `source`)

        def drain(gid: str) -> None:
            bare.set_draining(False)
            source.set_draining(True)

        # `bare` has no host tier to import into: the pull brings nothing
        ids, before = prompt(10), bare.engine.engine.stats()["tokens_computed"]
        tokens, record = moved(router, ids, CASES["greedy"], "failed", drain)
        computed = bare.engine.engine.stats()["tokens_computed"] - before
        check(record, tokens, undisturbed(reference, ids, CASES["greedy"], "failed-ref"), "src", False, computed)
    finally:
        source.shutdown()


# ---- on Ray: one group per node ------------------------------------------------------------

# Rank 0's engine runs ahead of a router that reads its stream: on a loaded machine it may
# finish 64 tokens before the router has read 30 and set the flag. A longer stream, and a
# flag set before the router reads on, leave it the time to see the drain mid-stream.
RAY_MAX_TOKENS = 256


def test_a_drained_stream_moves_with_its_kv_across_nodes(ray_runtime, local):
    *_, reference = local
    node_a, node_b = ray_runtime.node_labels
    index = InMemoryPrefixIndex()
    config = engine_config("builtin", **OPTIONS)
    groups = []
    try:
        for gid, node in (("r0", node_a), ("r1", node_b)):
            groups.append(RayGroup(config, RayGroupConfig(bundle_resources={node: 1}), group_id=gid, index=index))
        hasher, _, info = router_side(config, "builtin")
        by_id = {g.group_id: g for g in groups}
        for case, params in sorted(CASES.items()):
            params = dataclasses.replace(params, max_tokens=RAY_MAX_TOKENS)
            for g in groups:
                ray.get(g.ranks_owned.rank0.set_draining.remote(False))
            router = Router(groups, index, hasher, info)
            started = []

            def drain(gid: str, started: list[str] = started) -> None:
                if not started:
                    started.append(gid)
                    ray.get(by_id[gid].ranks_owned.rank0.set_draining.remote(True))

            ids, before = prompt(20 + sorted(CASES).index(case)), {g.group_id: g.engine_stats() for g in groups}
            tokens, record = moved(router, ids, params, f"ray-{case}", drain)
            after = by_id[record.group_id].engine_stats()
            computed = after["tokens_computed"] - before[record.group_id]["tokens_computed"]
            imported = after["kv_blocks_imported"] - before[record.group_id]["kv_blocks_imported"]
            reference_tokens = undisturbed(reference, ids, params, f"ray-{case}")
            check(record, tokens, reference_tokens, started[0], True, computed, RAY_MAX_TOKENS)
            assert imported == record.pulled_blocks
    finally:
        for g in groups:
            g.shutdown()
