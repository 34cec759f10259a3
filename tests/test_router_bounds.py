"""What a router keeps per request is bounded (benchmarks/soak.py): each request leaves a route
record and, for a new prompt, a segment in the hash-chain cache; past their caps, what the
router's own modules hold stays flat however many requests follow."""

from __future__ import annotations

import asyncio
import time
import tracemalloc
from collections.abc import AsyncIterator

from cluster.group import GroupHandle, GroupStatus
from cluster.index import InMemoryPrefixIndex
from router.hash_cache import HashCacheConfig, PrefixHashCache
from router.router import ModelInfo, Router, RouteRequest
from tests.factories import make_hasher
from worker.outputs import RequestMetrics, RequestOutput
from worker.sampling_params import SamplingParams

BLOCK = 16


class InstantGroup(GroupHandle):
    """A group that finishes every request at once with one token: the router alone runs."""

    group_id = "g0"

    async def generate(self, request) -> AsyncIterator[RequestOutput]:
        one = ("", [1], None, None, "length", None)
        yield RequestOutput(
            request.request_id,
            request.prompt,
            None,
            True,
            0,
            RequestMetrics(time.monotonic()),
            new_token_ids=[1],
            _one=one,
        )

    def abort(self, request_id: str) -> None:
        pass

    def status(self) -> GroupStatus:
        return GroupStatus("g0", True, 1, ("cpu",), 64, 64, 0, 0, 0, 0)

    def shutdown(self) -> None:
        pass


def make_router(max_records: int, cache_bytes: int) -> Router:
    hasher = make_hasher(block_size=BLOCK)
    router = Router([InstantGroup()], InMemoryPrefixIndex(), hasher, ModelInfo("t", 4096, BLOCK, "auto", 1024))
    router.max_records = max_records
    router.hash_cache = PrefixHashCache(hasher, HashCacheConfig(max_bytes=cache_bytes))
    return router


async def ask(router: Router, first: int, count: int) -> None:
    """`count` requests, each a prompt of its own (two full blocks and a partial one)."""
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    for i in range(first, first + count):
        ids = [(i >> 8) % 250 + 3, i % 250 + 3, *range(3, 3 + 2 * BLOCK + 5)]
        async for _ in router.generate(RouteRequest(prompt_token_ids=ids, params=params)):
            pass


def held_by_the_router(snapshot: tracemalloc.Snapshot) -> int:
    keep = [tracemalloc.Filter(True, "*/router/router.py"), tracemalloc.Filter(True, "*/router/hash_cache.py")]
    return sum(s.size for s in snapshot.filter_traces(keep).statistics("filename"))


def test_route_records_and_hash_chains_level_off_past_their_caps():
    router = make_router(max_records=300, cache_bytes=1 << 20)
    cap = router.hash_cache.max_entries
    assert 100 < cap < 300

    async def run() -> tuple[int, int]:
        await ask(router, 0, 600)  # past both caps
        tracemalloc.start()
        try:
            await ask(router, 600, 300)
            before = held_by_the_router(tracemalloc.take_snapshot())
            await ask(router, 900, 1500)
            return before, held_by_the_router(tracemalloc.take_snapshot())
        finally:
            tracemalloc.stop()

    before, after = asyncio.run(run())
    assert len(router.records) == 300
    assert len(router.hash_cache) <= cap
    assert router.hash_cache.stats.evictions > 0
    # unbounded, 1,500 more requests would hold ~500 KB more (~330 bytes each)
    assert after - before < 32 * 1024, (before, after)
