"""The router end to end over LocalGroups running the built-in model, with real Redis."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import replace

import numpy as np
import pytest

from cluster.index import FailoverReader, InMemoryPrefixIndex, RedisPrefixIndex
from cluster.local_group import LocalGroup
from pagefleet.llm import engine_config
from router.router import ModelInfo, Router, RouteRequest
from tests.factories import fail_after, wait_until
from tests.redis_server import RedisServer
from worker.sampling_params import SamplingParams

SECRET = "router-test-secret"
DOC = [(7 * i) % 1000 for i in range(160)]  # 10 blocks of 16


def info() -> ModelInfo:
    return ModelInfo("builtin", 4096, 16, "auto", 1024)


def ask(router: Router, question: int, salt: str | None = None, rid: str | None = None):
    req = RouteRequest(
        prompt_token_ids=DOC + [question] * 5,
        cache_salt=salt,
        request_id=rid,
        params=SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
    )

    async def run():
        return [out async for out in router.generate(req)][-1]

    out = asyncio.run(run())
    return out, router.records[out.request_id]


@pytest.fixture(scope="module")
def groups():
    index = InMemoryPrefixIndex()
    config = engine_config("builtin", num_blocks=64, max_model_len=512, cluster_secret=SECRET)
    made = [LocalGroup(config, index, group_id=f"g{i}") for i in range(2)]
    yield index, made
    for g in made:
        g.shutdown()


def wait_idle(groups, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(g.status().running + g.status().waiting for g in groups):
        time.sleep(0.02)


def wait_published(index, hashes, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(m.blocks for m in index.match(hashes).values()):
            return
        time.sleep(0.02)


def test_repeat_questions_go_to_the_holder_and_the_prediction_holds(groups):
    index, made = groups
    router = Router(made, index, made[0].hasher, info(), policy="prefix_aware")
    first, rec0 = ask(router, 901)
    assert rec0.actual_cached_tokens == first.num_cached_tokens
    wait_published(index, router.hasher.hash_prompt(DOC))
    for q in (902, 903):
        wait_idle(made)  # a 10-block document is worth less than a neighbour it would slow
        out, rec = ask(router, q)
        assert rec.group_id == rec0.group_id
        assert rec.predicted_cached_tokens == rec.actual_cached_tokens == out.num_cached_tokens
        assert out.num_cached_tokens == len(DOC)


def test_tenants_never_see_each_others_blocks(groups):
    index, made = groups
    router = Router(made, index, made[0].hasher, info())
    ask(router, 950, salt="tenant-a")
    wait_published(index, router.hasher.hash_prompt(DOC, cache_salt="tenant-a"))
    out, rec = ask(router, 950, salt="tenant-b")
    assert out.num_cached_tokens == 0 and rec.predicted_cached_tokens == 0
    out, rec = ask(router, 950, salt="tenant-a")
    assert out.num_cached_tokens > 0


def test_a_group_failing_before_the_first_token_is_retried_elsewhere(caplog):
    index = InMemoryPrefixIndex()
    config = engine_config("builtin", num_blocks=64, max_model_len=512, cluster_secret=SECRET)
    made = [LocalGroup(config, index, group_id=f"f{i}") for i in range(2)]
    try:
        router = Router(made, index, made[0].hasher, info(), policy="round_robin")

        def lost_device(out):
            raise RuntimeError("device lost")

        made[0].engine.engine.executor.execute = lost_device  # its next step dies
        with caplog.at_level(logging.WARNING):
            out, rec = ask(router, 960)
        assert rec.group_id == "f1" and out.finished
        assert "retrying elsewhere" in caplog.text
    finally:
        for g in made:
            g.shutdown()


def test_two_routers_over_one_redis_decide_alike_and_redis_failover_converges(caplog):
    """Groups publish to Redis and to this process's index; router a reads Redis behind a
    failover to that index, router b reads Redis alone."""
    with RedisServer() as server:
        ns = f"r{uuid.uuid4().hex[:6]}"
        local = InMemoryPrefixIndex()
        config = engine_config("builtin", num_blocks=64, max_model_len=512, cluster_secret=SECRET)
        writers = (local, RedisPrefixIndex.from_url(server.url, ns, "m"))
        made = [LocalGroup(config, writers, group_id=f"h{i}") for i in range(2)]
        try:
            reader = FailoverReader(RedisPrefixIndex.from_url(server.url, ns, "m"), local, 0.2)
            a = Router(made, reader, made[0].hasher, info())
            b_index = RedisPrefixIndex.from_url(server.url, ns, "m")
            b = Router(made, b_index, made[0].hasher, info())
            _, rec = ask(a, 970)
            hashes = a.hasher.hash_prompt(DOC + [971] * 5)
            wait_published(b_index, hashes)
            assert a.place(hashes).group_id == b.place(hashes).group_id == rec.group_id

            server.stop()  # Redis goes down mid-run: serving continues on the local index
            with caplog.at_level(logging.WARNING):
                out, rec2 = ask(a, 972)
            assert out.finished and rec2.group_id == rec.group_id
            assert out.num_cached_tokens == len(DOC)
            assert "unavailable" in caplog.text and not reader.shared_up

            server.start()  # back, empty: the groups' publishers register there again
            doc = a.hasher.hash_prompt(DOC)
            assert wait_until(
                lambda: (
                    b_index.match(doc).get(rec.group_id) is not None
                    and b_index.match(doc)[rec.group_id].blocks == len(DOC) // 16
                ),
                30,
            )
            assert wait_until(lambda: ask(a, 973) and reader.shared_up, 10)
        finally:
            for g in made:
                g.shutdown()


def test_the_vocabulary_check_names_the_bad_token_and_passes_the_array_to_hashing(groups):
    index, made = groups
    router = Router(made, index, made[0].hasher, info())
    for bad in (-1, 1024, 2**40, 3.0, "7"):
        with pytest.raises(ValueError, match=f"token id {bad!r} is outside"):
            router.tokenize(RouteRequest(prompt_token_ids=[1, 2, bad, 3]))
    ids, checked = router.checked_prompt(RouteRequest(prompt_token_ids=DOC))
    assert ids == DOC and list(checked) == DOC and checked.typecode == "I"
    assert router.hash_cache.hash_prompt(checked) == made[0].hasher.hash_prompt(DOC)
    # A numpy array (what the gRPC door passes on) is checked alike and stays an array, the
    # uint32 one, up to the engine: no list of Python ints is made on the way.
    for dtype in (np.int64, np.int32, np.uint16):
        ids, checked = router.checked_prompt(RouteRequest(prompt_token_ids=np.array(DOC, dtype)))
        assert ids is checked and list(checked) == DOC and checked.typecode == "I"
        tokens = router.tokenize(RouteRequest(prompt_token_ids=np.array(DOC, dtype)))
        assert tokens == DOC and all(type(t) is int for t in tokens)
    for bad in (-1, 1024, 2**40):
        with pytest.raises(ValueError, match=f"token id {bad} is outside"):
            router.tokenize(RouteRequest(prompt_token_ids=np.array([1, 2, bad, 3])))
    for bad in (np.array([1.0, 2.0]), np.array([[1, 2]]), np.array([], np.int64)):
        with pytest.raises(ValueError, match="1-d array of integers|prompt is empty"):
            router.tokenize(RouteRequest(prompt_token_ids=bad))


def test_own_placements_count_while_the_shared_index_is_down(caplog):
    from cluster.sim_group import SimGroup, SimGroupConfig
    from worker.hashing import BlockHasher, ModelFingerprint

    hasher = BlockHasher(b"down-secret", ModelFingerprint("m", block_size=16))
    groups = [SimGroup(f"g{i}", SimGroupConfig(num_blocks=512), hasher) for i in range(3)]
    server = RedisServer()
    server.start()
    index = RedisPrefixIndex.from_url(server.url, "down", "m", socket_timeout_s=0.2)
    router = Router(groups, index, hasher, ModelInfo("m", 4096, 16, "auto", 1000))
    server.stop()  # down before the first placement: nothing reaches Redis
    chain = hasher.hash_prompt(list(range(1600)))
    with caplog.at_level(logging.WARNING):
        first = router.place(chain)
        second = router.place(chain)
    assert "prefix index unavailable" in caplog.text
    assert (second.group_id, second.cached_blocks) == (first.group_id, len(chain))
    index.close()
    server.close()


def test_statuses_follow_what_groups_report_and_every_group_is_read_each_second(monkeypatch):
    """Groups that tell of their changes (`watch`) are read again only when they change; the
    router still sees every change at its next decision, a stopped group leaves at once, and
    every group is read again once a second (here: at once) even without a word."""
    from cluster.sim_group import SimGroup, SimGroupConfig
    from router import router as router_module
    from worker.engine.request import Request
    from worker.hashing import BlockHasher, ModelFingerprint

    hasher = BlockHasher(b"board-secret", ModelFingerprint("m", block_size=16))
    groups = [SimGroup(f"g{i}", SimGroupConfig(num_blocks=512), hasher) for i in range(3)]
    router = Router(groups, InMemoryPrefixIndex(), hasher, ModelInfo("m", 4096, 16, "auto", 1000))
    assert sorted(router.live_statuses()) == ["g0", "g1", "g2"]
    reads = dict.fromkeys(("g0", "g1", "g2"), 0)

    def counted(group):
        status = group.status

        def read():
            reads[group.group_id] += 1
            return status()

        return read

    for g in groups:
        monkeypatch.setattr(g, "status", counted(g))
    for _ in range(3):
        router.live_statuses()
    assert reads == {"g0": 0, "g1": 0, "g2": 0}  # nothing changed: nothing read
    groups[1].submit("r1", list(range(100)), 4, now=0.0)
    assert router.live_statuses()["g1"].waiting == 1
    assert reads == {"g0": 0, "g1": 1, "g2": 0}
    groups[2].shutdown()
    assert sorted(router.live_statuses()) == ["g0", "g1"]
    # A change the group does not tell of (a request put in its scheduler behind its back)
    # shows at the next full read.
    quiet = Request(
        "quiet", list(range(50)), SamplingParams(max_tokens=2), max_tokens=2, arrival_time=0.0, hash_root=hasher.root()
    )
    groups[0].scheduler.add_request(quiet)
    groups[0]._status = None
    assert router.live_statuses()["g0"].waiting == 0
    monkeypatch.setattr(router_module, "STATUS_REFRESH_S", 0.0)
    assert router.live_statuses()["g0"].waiting == 1


def test_a_full_queue_sends_the_request_to_the_next_group_before_refusing_it():
    """Each group runs one request and queues one. With q0's queue full, the router's first
    choice (round robin: q0) refuses the request and q1 takes it; with both full, it is
    refused."""
    from worker.protocol import GenerationRequest, QueueFullError

    index = InMemoryPrefixIndex()
    config = engine_config(
        "builtin", num_blocks=64, max_model_len=512, cluster_secret=SECRET, max_num_seqs=1, max_waiting=1
    )
    made = [LocalGroup(config, index, group_id=f"q{i}") for i in range(2)]
    router = Router(made, index, made[0].hasher, info(), policy="round_robin")
    long = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
    short = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)

    async def consume(stream, started: asyncio.Event) -> None:
        async for _ in stream:
            started.set()

    async def fill(group) -> list:
        """One request running (it has produced a token), then one waiting."""
        tasks = []
        for q in (40, 41):
            request = GenerationRequest(DOC + [q] * 5, long, request_id=f"{group.group_id}-{q}")
            started = asyncio.Event()
            tasks.append(asyncio.ensure_future(consume(group.generate(request), started)))
            while not (started.is_set() if q == 40 else group.status().waiting == 1):
                assert not any(t.done() for t in tasks), [t.exception() for t in tasks if t.done()]
                await asyncio.sleep(0.01)
        return tasks

    async def run():
        fillers = await fill(made[0])
        out = [o async for o in router.generate(RouteRequest(prompt_token_ids=DOC + [44] * 5, params=short))][-1]
        spilled = router.records[out.request_id].group_id
        fillers += await fill(made[1])
        with pytest.raises(QueueFullError, match="every live group's queue is full"):
            await router.generate(RouteRequest(prompt_token_ids=DOC + [45] * 5, params=short)).__anext__()
        for t in fillers:
            t.cancel()
        await asyncio.gather(*fillers, return_exceptions=True)
        return spilled

    try:
        assert asyncio.run(run()) == "q1"
    finally:
        for g in made:
            g.shutdown()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=1),
        SamplingParams(max_tokens=40, temperature=1.0, seed=11, ignore_eos=True, stop=["zz"]),
    ],
    ids=["greedy", "seeded"],
)
def test_a_group_dying_mid_stream_has_its_streams_resumed_elsewhere(params, caplog):
    """Its device fails after 12 steps: the stream goes on on the other group, no token
    missing or repeated, equal to an undisturbed run (seeded too), and says it was resumed."""
    index = InMemoryPrefixIndex()
    config = engine_config("builtin", num_blocks=64, max_model_len=512, cluster_secret=SECRET)
    made = [LocalGroup(config, index, group_id=f"m{i}") for i in range(2)]
    prompt = RouteRequest(prompt_token_ids=DOC + [5] * 7, params=params)
    try:
        router = Router(made, index, made[0].hasher, info(), policy="round_robin")

        async def stream():
            return [o async for o in router.generate(replace(prompt, request_id=None))]

        whole = asyncio.run(stream())  # undisturbed, on m0 (round robin)
        assert router.records[whole[-1].request_id].group_id == "m0"
        fail_after(made[1], 12)  # the next one goes to m1, which dies after 12 steps
        with caplog.at_level(logging.WARNING):
            moved = asyncio.run(stream())
        record = router.records[moved[-1].request_id]
        assert "resuming it elsewhere" in caplog.text and record.resumes == 1
        assert record.group_id == "m0" and not made[1].status().alive
        assert [t for o in moved for t in o.new_token_ids] == whole[-1].token_ids
        assert "".join(o.new_text for o in moved) == whole[-1].text
        last = moved[-1]
        assert last.finished and last.token_ids == whole[-1].token_ids
        if params.logprobs is not None:
            assert [lp.token_id for lp in last.logprobs] == whole[-1].token_ids
        assert last.metrics.first_token_time == moved[0].metrics.first_token_time
    finally:
        for g in made:
            g.shutdown()
