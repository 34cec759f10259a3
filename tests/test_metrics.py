"""What the door's metrics count, with vLLM's meanings: the shared request path
(router/door/serving.py: `outputs`) over a real router and real LocalGroups running the built-in
model, read from the real prometheus_client registry. Each request ends exactly once (finished,
cancelled, refused, failed, retried or resumed on another group), its tokens are counted as they
come, and its times are the engine's own intervals."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from cluster.index import InMemoryPrefixIndex
from cluster.local_group import LocalGroup
from pagefleet.llm import engine_config
from router.door.metrics import ServerMetrics, token_buckets
from router.door.serving import InFlight, outputs
from router.router import ModelInfo, NoGroupAvailableError, Router, RouteRequest
from worker.sampling_params import SamplingParams

SECRET = "metrics-test-secret"
NAME = "builtin"
PROMPT = [(11 * i) % 1000 for i in range(40)]


def make_groups(n: int, prefix: str) -> list[LocalGroup]:
    config = engine_config("builtin", num_blocks=64, max_model_len=512, cluster_secret=SECRET)
    index = InMemoryPrefixIndex()
    return [LocalGroup(config, index, group_id=f"{prefix}{i}") for i in range(n)]


@pytest.fixture(scope="module")
def groups():
    made = make_groups(2, "m")
    yield made
    for g in made:
        g.shutdown()


def route(groups: list[LocalGroup], hasher=None) -> Router:
    """A round-robin router over `groups` (its own index: placement reads only their status)."""
    info = ModelInfo(NAME, 512, 16, "auto", 1024)
    hasher = hasher or groups[0].hasher
    return Router(groups, InMemoryPrefixIndex(), hasher, info, policy="round_robin")


def request(max_tokens: int, prompt=PROMPT) -> RouteRequest:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return RouteRequest(prompt_token_ids=list(prompt), params=params, request_id=f"q{time.time_ns()}")


class Read:
    """Sample values of one ServerMetrics' registry."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.registry = metrics.registry

    def __call__(self, name: str, **labels) -> float:
        total = 0.0
        for family in self.registry.collect():
            for s in family.samples:
                if s.name == f"pagefleet:{name}" and all(s.labels.get(k) == v for k, v in labels.items()):
                    total += s.value
        return total


async def consume(stream, stop_after: int | None = None):
    """The outputs of `stream`, all of them or the first `stop_after` (then it is closed)."""
    got = []
    async with contextlib.aclosing(stream):
        async for out, _record in stream:
            got.append(out)
            if stop_after is not None and len(got) == stop_after:
                break
    return got


def run(router: Router, metrics: ServerMetrics, req: RouteRequest, received=None, stop_after=None):
    t0 = time.perf_counter() if received is None else received
    return asyncio.run(consume(outputs(router, router.check(req), metrics, InFlight(), t0), stop_after))


def test_a_finished_request_is_observed_once_with_the_engines_intervals(groups):
    metrics, router = ServerMetrics(NAME, 512), route(groups)
    read = Read(metrics)
    received = time.perf_counter() - 0.5  # the door took the call half a second ago
    outs = run(router, metrics, request(6), received=received)
    done, m = outs[-1], outs[-1].metrics
    assert done.finished and len(done.token_ids) == 6
    assert read("request_success_total", finished_reason="length") == 1
    assert read("request_errors_total") == 0
    for name in (
        "e2e_request_latency_seconds",
        "time_to_first_token_seconds",
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "request_inference_time_seconds",
        "request_time_per_output_token_seconds",
        "request_prompt_tokens",
        "request_generation_tokens",
    ):
        assert read(f"{name}_count") == 1, name
    assert read("inter_token_latency_seconds_count") == 5
    assert read("time_to_first_token_seconds_sum") >= 0.5 + m.ttft  # from the door's receipt
    decode = m.token_times[-1] - m.token_times[0]  # the engine's own clock
    prefill = m.first_token_time - m.first_scheduled_time
    assert read("request_decode_time_seconds_sum") == pytest.approx(decode, abs=1e-9)
    assert read("inter_token_latency_seconds_sum") == pytest.approx(decode, abs=1e-9)
    assert read("request_prefill_time_seconds_sum") == pytest.approx(prefill, abs=1e-9)
    assert read("request_queue_time_seconds_sum") == pytest.approx(m.queue_time, abs=1e-9)
    assert read("request_inference_time_seconds_sum") == pytest.approx(prefill + decode, abs=1e-9)
    assert read("request_time_per_output_token_seconds_sum") == pytest.approx(decode / 5, abs=1e-9)
    assert read("prompt_tokens_total") == read("request_prompt_tokens_sum") == len(PROMPT)
    assert read("generation_tokens_total") == read("request_generation_tokens_sum") == 6
    group = router.records[done.request_id].group_id
    assert read("routing_decisions_total", group=group, reason="round_robin") == 1
    assert read("routed_prompt_tokens_total", group=group) == len(PROMPT)
    assert read("actual_cached_tokens_total", group=group) == done.num_cached_tokens
    # queue and prefill times resolve milliseconds (vLLM's request buckets start at 0.3 s)
    assert read("request_queue_time_seconds_bucket", le="0.005") == 1


def test_token_counters_move_while_a_request_generates(groups):
    metrics, router = ServerMetrics(NAME, 512), route(groups)
    read = Read(metrics)
    seen = []

    async def watch():
        stream = outputs(router, router.check(request(60)), metrics, InFlight(), time.perf_counter())
        arrived = 0  # (not len(out.token_ids): in-process, that is the engine's list, growing on)
        async with contextlib.aclosing(stream):
            async for out, _ in stream:
                arrived += len(out.new_token_ids)
                if not out.finished:  # mid-stream: what has reached the door is counted
                    seen.append(
                        (
                            arrived,
                            read("generation_tokens_total"),
                            read("prompt_tokens_total"),
                            read("request_success_total"),
                        )
                    )

    asyncio.run(watch())
    assert len(seen) == 59 and seen[-1][0] == 59
    assert all(gen == n and prompt == len(PROMPT) and ended == 0 for n, gen, prompt, ended in seen), seen


def test_a_cancelled_request_is_counted_once(groups):
    metrics, router = ServerMetrics(NAME, 512), route(groups)
    read = Read(metrics)
    outs = run(router, metrics, request(300), stop_after=3)  # the client goes away
    assert not outs[-1].finished
    assert read("request_errors_total", code="CANCELLED") == 1
    assert read("request_errors_total") == 1 and read("request_success_total") == 0
    assert read("e2e_request_latency_seconds_count") == 1
    assert read("generation_tokens_total") == read("request_generation_tokens_sum") == 3
    assert read("inter_token_latency_seconds_count") == 2
    assert read("request_decode_time_seconds_count") == 1  # every request observed, however it ends


def test_a_request_refused_by_every_group_is_counted_once(groups):
    metrics = ServerMetrics(NAME, 512)
    read = Read(metrics)
    router = route([], hasher=groups[0].hasher)  # no live group
    with pytest.raises(NoGroupAvailableError):
        run(router, metrics, request(4))
    assert read("request_errors_total", code="UNAVAILABLE") == 1
    assert read("request_errors_total") == 1 and read("request_success_total") == 0
    assert read("e2e_request_latency_seconds_count") == 1
    assert read("time_to_first_token_seconds_count") == read("prompt_tokens_total") == 0
    assert read("routing_decisions_total") == 0


def lost_device(out):
    raise RuntimeError("device lost")


def test_a_request_retried_on_another_group_is_counted_once():
    """Its first group dies before the first token: the router places it again."""
    made = make_groups(2, "r")
    try:
        metrics, router = ServerMetrics(NAME, 512), route(made)
        read = Read(metrics)
        made[0].engine.engine.executor.execute = lost_device  # its next step dies
        outs = run(router, metrics, request(5))
        assert outs[-1].finished and router.records[outs[-1].request_id].group_id == "r1"
        assert read("request_success_total") == 1 and read("request_errors_total") == 0
        assert read("prompt_tokens_total") == len(PROMPT) and read("generation_tokens_total") == 5
        assert read("time_to_first_token_seconds_count") == read("e2e_request_latency_seconds_count") == 1
        assert read("routing_decisions_total", group="r1") == 1
        assert read("request_resumes_total") == 0  # no token had reached the client
    finally:
        for g in made:
            g.shutdown()


def test_a_request_whose_group_dies_mid_stream_is_counted_once():
    """Its group dies after 3 tokens and the router resumes it on the other group: one request
    that finished, with one resume, every token counted once, prefilled once for the client, and
    one time to first token (the first group's)."""
    made = make_groups(2, "k")
    try:
        metrics, router = ServerMetrics(NAME, 512), route(made)
        read = Read(metrics)
        got, placements = [], []

        async def go():
            stream = outputs(router, router.check(request(12)), metrics, InFlight(), time.perf_counter())
            async with contextlib.aclosing(stream):
                async for out, record in stream:
                    got.append(out)
                    if record is not None:
                        placements.append(record.group_id)
                    if len(got) == 3:  # the group holding it dies
                        group = made[int(router.records[out.request_id].group_id[1:])]
                        group.engine.engine.executor.execute = lost_device

        asyncio.run(go())
        assert got[-1].finished and len(got[-1].token_ids) == 12
        assert len(placements) == 2 and placements[0] != placements[1]  # the resume's group
        assert read("request_resumes_total") == 1
        assert read("request_success_total") == 1 and read("request_errors_total") == 0
        assert read("generation_tokens_total") == read("request_generation_tokens_sum") == 12
        assert read("prompt_tokens_total") == len(PROMPT)
        assert read("time_to_first_token_seconds_count") == 1
        assert read("e2e_request_latency_seconds_count") == 1
        assert read("inter_token_latency_seconds_count") == 11  # one gap per token after the first
        assert read("routing_decisions_total") == 2  # the first placement and the resume's
    finally:
        for g in made:
            g.shutdown()


def test_token_buckets_are_vllms_1_2_5_series():
    assert token_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert token_buckets(512)[-1] == 500
