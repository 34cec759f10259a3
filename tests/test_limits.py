"""Tenants' limits at the door (router/door/limits.py): the configuration's checks, and the
same windows in the process and in a real redis-server, shared by two router replicas."""

from __future__ import annotations

import uuid

import pytest
import redis

from router.door.limits import LocalLimiter, RateLimited, RedisLimiter, TenantLimits, parse_tenants


class Clock:
    def __init__(self, now: float = 1_000_000.25) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def limiters(redis_server, limits, clock):
    """A local limiter, and two Redis ones over one server (two router replicas)."""
    client = redis.Redis.from_url(redis_server.url)
    cluster = f"lim-{uuid.uuid4().hex[:8]}"
    return (
        LocalLimiter(limits, clock),
        RedisLimiter(client, cluster, limits, clock),
        RedisLimiter(redis.Redis.from_url(redis_server.url), cluster, limits, clock),
    )


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"acme": {"rate": 5}}, r"tenants.acme: unknown field\(s\) \['rate'\]"),
        ({"acme": {"requests_per_s": 0}}, r"tenants.acme.requests_per_s must be a number > 0, got 0"),
        ({"acme": {"concurrent": 2.5}}, r"tenants.acme.concurrent must be an integer > 0, got 2.5"),
        ({"acme": {"weight": "high"}}, r"tenants.acme.weight must be a number > 0"),
        ({"acme": {"tokens_per_min": True}}, r"tenants.acme.tokens_per_min must be an integer > 0"),
        ({"a b": {}}, r"tenants: 'a b' is not a tenant name"),
        ({"acme": [1]}, r"tenants.acme must be a mapping"),
        ([1, 2], r"tenants must be a mapping"),
    ],
)
def test_a_bad_tenants_section_is_refused_naming_the_tenant_and_field(section, message):
    with pytest.raises(ValueError, match=message):
        parse_tenants(section)


def test_a_good_section_parses():
    got = parse_tenants({"acme": {"weight": 2, "requests_per_s": 5, "concurrent": 3}, "free": None})
    assert got == {"acme": TenantLimits(2, 5, None, 3), "free": TenantLimits()}
    assert got["acme"].limited and not got["free"].limited


def refused(limiter, tenant, rid, tokens=1) -> RateLimited | None:
    try:
        limiter.admit(tenant, rid, tokens)
    except RateLimited as e:
        return e
    return None


def test_requests_per_second_in_the_process_and_in_redis_alike(redis_server):
    clock = Clock()
    for lim in limiters(redis_server, {"acme": TenantLimits(requests_per_s=3)}, clock)[:2]:
        clock.now = 1_000_000.25
        assert [refused(lim, "acme", f"r{i}") for i in range(3)] == [None] * 3
        e = refused(lim, "acme", "r3")
        assert e is not None and e.limit == "requests_per_s" and e.retry_after_s == pytest.approx(0.75)
        assert "3 requests per second" in str(e)
        assert refused(lim, "other", "x") is None  # not a limited tenant
        clock.now += 1.0  # the next second
        assert refused(lim, "acme", "r4") is None


def test_a_rate_under_one_a_second_admits_one_request_per_its_window(redis_server):
    """0.05 requests/s is one request per 20 s (a one-second window would never admit one)."""
    clock = Clock()
    for lim in limiters(redis_server, {"trial": TenantLimits(requests_per_s=0.05)}, clock)[:2]:
        clock.now = 1_000_000.0 + 5.0  # 5 s into a 20 s window (1_000_000 is a multiple of 20)
        assert refused(lim, "trial", "a") is None
        e = refused(lim, "trial", "b")
        assert e is not None and e.limit == "requests_per_s" and e.retry_after_s == pytest.approx(15.0)
        clock.now += 15.0  # the next window
        assert refused(lim, "trial", "c") is None


def test_tokens_per_minute_count_prompt_and_output(redis_server):
    clock = Clock()
    for lim in limiters(redis_server, {"acme": TenantLimits(tokens_per_min=100)}, clock)[:2]:
        clock.now = 60 * 20_000 + 10.0
        assert refused(lim, "acme", "a", tokens=60) is None
        lim.finish("acme", "a", 30)  # 90 in this minute
        assert refused(lim, "acme", "b", tokens=20) is None  # under the limit when admitted
        e = refused(lim, "acme", "c", tokens=1)
        assert e is not None and e.limit == "tokens_per_min" and 0 < e.retry_after_s <= 60


def test_requests_in_flight_and_their_release(redis_server):
    clock = Clock()
    for lim in limiters(redis_server, {"acme": TenantLimits(concurrent=2)}, clock)[:2]:
        assert refused(lim, "acme", "a") is None and refused(lim, "acme", "b") is None
        e = refused(lim, "acme", "c")
        assert e is not None and e.limit == "concurrent" and e.retry_after_s == 1.0
        lim.finish("acme", "a", 0)
        assert refused(lim, "acme", "c") is None


def test_two_router_replicas_share_one_limit_through_redis(redis_server):
    """Replica 1 admits two of the tenant's three a second, replica 2 the third; the fourth is
    refused at either."""
    clock = Clock(2_000_000.5)
    _, one, two = limiters(redis_server, {"acme": TenantLimits(requests_per_s=3, concurrent=10)}, clock)
    assert refused(one, "acme", "a") is None and refused(one, "acme", "b") is None
    assert refused(two, "acme", "c") is None
    assert refused(two, "acme", "d").limit == "requests_per_s"
    assert refused(one, "acme", "e").limit == "requests_per_s"
