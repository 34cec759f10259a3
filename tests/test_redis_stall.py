"""A hung Redis (SIGSTOP) must not stall decoding: a group's engine thread hands its KV events
and load to a publisher thread and never waits on the network. Once Redis answers again, the
index holds exactly the group's blocks.

Before, rank 0 published from its engine thread: with Redis stopped, every stream of a group
paused 2-3.3 s at a time (a socket timeout, its retry, then each reconnect).
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import redis

from cluster.index import GroupPublisher, PublisherConfig, RedisPrefixIndex
from cluster.ray.config import RayGroupConfig
from cluster.ray.group import RayGroup
from cluster.ray.rank_actor import IndexTarget
from cluster.ray.ranks import RankSet
from pagefleet.llm import engine_config
from worker.hashing import BlockHasher, ModelFingerprint
from worker.kv_events import BlockRemoved, BlockStored
from worker.protocol import GenerationRequest
from worker.sampling_params import SamplingParams

HASHER = BlockHasher(b"stall-secret", ModelFingerprint("stall", block_size=4))
PAUSE_S = 4.0  # longer than the index's heartbeat TTL (3 s): the registration lapses too
# Both bounds hold with room on a busy 2-core machine; before, a call alone took 1-2 s.
STEP_CALL_MAX_S = 0.05  # one publish_step on the engine's thread
TOKEN_GAP_MAX_S = 0.5  # between two outputs of a decoding stream


def inventory(index: RedisPrefixIndex, group_id: str) -> set[bytes]:
    return set(index.client.smembers(f"{index.prefix}inv:{group_id}"))


@pytest.mark.parametrize("max_queued", [65536, 3], ids=["queued", "overflowing"])
def test_publishing_to_a_hung_redis_never_blocks_the_step_and_the_index_catches_up(redis_server, max_queued):
    """Steps go on at full speed with Redis stopped; after SIGCONT the index holds exactly the
    cache, whether the queued events were kept or (past `max_queued_events`) replaced by a
    snapshot."""
    index = RedisPrefixIndex.from_url(redis_server.url, f"hang{max_queued}", "m1")
    cache: set[bytes] = set()
    config = PublisherConfig(retry_initial_s=0.1, retry_max_s=0.5, max_queued_events=max_queued)
    pub = GroupPublisher(index, "g0", lambda: set(cache), config)
    chain = HASHER.hash_prompt(list(range(4 * 40)))
    slowest, step = 0.0, 0

    def engine_step() -> None:  # the block manager's changes, then the step's publish
        nonlocal slowest, step
        h = chain[step % len(chain)]
        event = BlockRemoved((h,)) if h in cache and step % 3 == 0 else BlockStored((h,), None)
        (cache.add if isinstance(event, BlockStored) else cache.discard)(h)
        started = time.monotonic()
        pub.publish_step([event])
        slowest = max(slowest, time.monotonic() - started)
        step += 1

    try:
        for _ in range(20):
            engine_step()
        redis_server.pause()
        paused_until = time.monotonic() + PAUSE_S
        while time.monotonic() < paused_until:
            engine_step()
            time.sleep(0.005)
    finally:
        redis_server.resume()
    print(f"slowest publish_step with Redis stopped: {slowest * 1000:.2f} ms over {step} steps")
    assert slowest < STEP_CALL_MAX_S
    for _ in range(40):  # and on after Redis is back
        engine_step()
        time.sleep(0.005)
    deadline = time.monotonic() + 15
    while inventory(index, "g0") != cache:
        assert time.monotonic() < deadline, "the index did not catch up with the cache"
        pub.publish_step([])  # the engine's idle ticks
        time.sleep(0.05)
    pub.close()
    assert inventory(index, "g0") == set()
    index.close()


@pytest.fixture(scope="module")
def redis_group(ray_runtime, redis_server):
    """A one-rank Ray group whose rank 0 publishes to the Redis index itself, and a handle
    that streams its outputs."""
    config = engine_config("builtin", num_blocks=256, max_model_len=1024, cluster_secret="stall")
    gc = RayGroupConfig(start_timeout_s=300)
    target = IndexTarget("stall-0", redis_server.url, cluster="stall", model="m1")
    ranks = RankSet(config, gc, target)
    ranks.wait_ready()
    group = RayGroup.attach("stall-0", ranks.rank0, gc, ranks.ranks, subscriber="stall-test")
    try:
        yield group, ranks
    finally:
        group.shutdown()
        ranks.shutdown()


def stream_times(group: RayGroup, prompt: list[int], max_tokens: int) -> list[float]:
    """When each output of one greedy stream arrived."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    async def run() -> list[float]:
        times = []
        async for _ in group.generate(GenerationRequest(prompt, params)):
            times.append(time.monotonic())
        return times

    return asyncio.run(run())


def test_a_group_decodes_on_while_redis_is_stopped(redis_group, redis_server):
    """Streams run back to back (each makes new blocks, so KV events) while Redis is SIGSTOPped
    for PAUSE_S: no gap between two outputs of a stream passes TOKEN_GAP_MAX_S. After SIGCONT
    the index holds exactly the blocks of rank 0's prefix cache."""
    import ray

    group, ranks = redis_group
    index = RedisPrefixIndex.from_url(redis_server.url, "stall", "m1")
    stream_times(group, [1, 2, 3], 4)  # warm
    window: list[float] = []

    def pause() -> None:
        time.sleep(0.5)
        redis_server.pause()
        window.append(time.monotonic())
        time.sleep(PAUSE_S)
        redis_server.resume()
        window.append(time.monotonic())

    stopper = threading.Thread(target=pause)
    stopper.start()
    gaps, n = [], 0
    try:
        while stopper.is_alive() or n < 2:
            times = stream_times(group, [(97 * n + 5 + i) % 1000 for i in range(40)], 64)
            gaps += [(b - a, a) for a, b in zip(times, times[1:], strict=False)]
            n += 1
    finally:
        stopper.join()
        redis_server.resume()
    start, end = window
    during = [g for g, at in gaps if start <= at <= end]
    print(
        f"{n} streams; largest gap {max(g for g, _ in gaps) * 1000:.0f} ms, "
        f"{max(during) * 1000:.0f} ms while Redis was stopped ({len(during)} gaps)"
    )
    assert len(during) > 20, "no stream decoded while Redis was stopped"
    assert max(g for g, _ in gaps) < TOKEN_GAP_MAX_S

    def exact() -> bool:
        held = set(ray.get(ranks.rank0.cached_hashes.remote(), timeout=30))
        return bool(held) and inventory(index, "stall-0") == held

    deadline = time.monotonic() + 20
    while not exact():
        assert time.monotonic() < deadline, "the index does not hold the group's blocks"
        time.sleep(0.2)
    admin = redis.Redis.from_url(redis_server.url)
    assert admin.get("pf:stall:m1:hb:stall-0") is not None
    index.close()
