"""Tenants' limits at the door: requests per second, tokens per minute, requests in flight.

A tenant (an API key's, or the one a keyless gRPC call names) may be given limits in the
`tenants:` section of the serving configuration (`parse_tenants`): its weight in a group's fair
share (worker/engine/fair_queue.py) and, each optional,

- `requests_per_s`: requests admitted in any one second (a window of whole seconds);
- `tokens_per_min`: prompt tokens at admission plus output tokens at the end, in any one minute
  (a window of whole minutes; a request admitted under the limit runs to its end);
- `concurrent`: requests of the tenant in flight at once;
- `max_documents`: documents it may keep pinned at once (router/documents.py; 16 unless given);
- `kv_quota`: its share of each group's device KV pool (0-1) or bytes per device ("64MiB"): its
  unreferenced cached blocks beyond it are evicted first (worker/engine/block_manager.py);
  `kv_host_quota`, `kv_disk_quota`: the same for the host and disk tiers under the pool (a share
  of the tier or bytes per device; worker/engine/tier_index.py).

A request over a limit is refused before it reaches a group: gRPC RESOURCE_EXHAUSTED, HTTP 429,
each with when to retry (the end of the window; 1 s for the concurrency limit), counted per
tenant and limit. Every router replica enforces the same windows: in Redis when the cluster has
one (`RedisLimiter`: one script per admission, so two replicas never both admit the last slot),
in the process otherwise (`LocalLimiter`). Requests in flight are held in Redis with a deadline,
so a router that dies releases its requests' slots when their deadline passes.
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from worker.config import check_kv_quota

_TENANT = re.compile(r"[A-Za-z0-9_.\-]{1,128}")  # as the gRPC API's `tenant` field
HELD_S = 3600.0  # a request in flight holds its slot at most this long (a router that died)
# a tenant's KV quota fields -> the engine option that takes them (worker/config.py: CacheConfig)
KV_QUOTA_FIELDS = {
    "kv_quota": "tenant_kv_quotas",
    "kv_host_quota": "tenant_kv_host_quotas",
    "kv_disk_quota": "tenant_kv_disk_quotas",
}


@dataclass(frozen=True)
class TenantLimits:
    """One tenant's weight and limits (None: unlimited)."""

    weight: float = 1.0
    requests_per_s: float | None = None
    tokens_per_min: int | None = None
    concurrent: int | None = None
    max_documents: int | None = None  # live documents at once (router/documents.py)
    kv_quota: float | int | None = None  # share of the device pool, or bytes (CacheConfig.tenant_kv_quotas)
    kv_host_quota: float | int | None = None  # of the host tier (CacheConfig.tenant_kv_host_quotas)
    kv_disk_quota: float | int | None = None  # of the disk tier (CacheConfig.tenant_kv_disk_quotas)

    @property
    def request_window_s(self) -> float:
        """The window `requests_per_s` is counted over: one second, or as long as one request
        takes at a rate under one a second (0.05/s: one request per 20 s)."""
        rps = self.requests_per_s
        return 1.0 if rps is None or rps >= 1 else 1.0 / rps

    @property
    def requests_per_window(self) -> float:
        return (self.requests_per_s or 0.0) * self.request_window_s

    @property
    def limited(self) -> bool:
        return any(v is not None for v in (self.requests_per_s, self.tokens_per_min, self.concurrent))


def parse_tenants(section: Mapping[str, Any] | None, where: str = "tenants") -> dict[str, TenantLimits]:
    """The `tenants:` section (tenant -> {field: value}) checked: a ValueError naming the tenant
    and the field for an unknown field, a bad name or a value that is not a number > 0.
    `where`: what the messages name as the source (`tenants`, or a key file)."""
    out: dict[str, TenantLimits] = {}
    if not section:
        return out
    if not isinstance(section, Mapping):
        raise ValueError(f"{where} must be a mapping of tenant name to its limits")
    known = {f.name for f in fields(TenantLimits)}
    for tenant, spec in section.items():
        if not isinstance(tenant, str) or not _TENANT.fullmatch(tenant):
            raise ValueError(f"{where}: {tenant!r} is not a tenant name (1-128 of A-Z a-z 0-9 _ . -)")
        spec = spec or {}
        if not isinstance(spec, Mapping):
            raise ValueError(f"{where}.{tenant} must be a mapping of its limits, got {spec!r}")
        unknown = sorted(set(spec) - known)
        if unknown:
            raise ValueError(f"{where}.{tenant}: unknown field(s) {unknown}; known: {sorted(known)}")
        spec = dict(spec)
        for name in KV_QUOTA_FIELDS:
            if name in spec:
                spec[name] = check_kv_quota(f"{where}.{tenant}.{name}", spec[name])
        for name, value in spec.items():
            if name in KV_QUOTA_FIELDS:
                continue
            whole = name in ("tokens_per_min", "concurrent", "max_documents")
            ok = isinstance(value, int) if whole else isinstance(value, int | float)
            if isinstance(value, bool) or not ok or not value > 0 or not math.isfinite(value):
                kind = "an integer" if whole else "a number"
                raise ValueError(f"{where}.{tenant}.{name} must be {kind} > 0, got {value!r}")
        out[tenant] = TenantLimits(**spec)
    return out


class RateLimited(Exception):
    """A request over one of its tenant's limits; `retry_after_s`: when a retry may pass."""

    def __init__(self, tenant: str, limit: str, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.tenant = tenant
        self.limit = limit  # requests_per_s, tokens_per_min or concurrent
        self.retry_after_s = retry_after_s


class Limiter:
    """What the door asks before and after a request of a limited tenant."""

    def __init__(self, limits: Mapping[str, TenantLimits], clock: Callable[[], float] = time.time) -> None:
        self.limits = {t: lim for t, lim in limits.items() if lim.limited}
        self.clock = clock

    def applies(self, tenant: str) -> bool:
        return tenant in self.limits

    def admit(self, tenant: str, request_id: str, prompt_tokens: int) -> None:
        """Count the request in, or RateLimited (and nothing counted)."""
        lim = self.limits.get(tenant)
        if lim is None:
            return
        now = self.clock()
        verdict = self._admit(tenant, request_id, prompt_tokens, lim, now)
        if verdict is not None:
            raise _refusal(tenant, lim, verdict, now)

    def finish(self, tenant: str, request_id: str, output_tokens: int) -> None:
        """The request ended: its slot is free, its output tokens count in this minute."""
        if tenant in self.limits:
            self._finish(tenant, request_id, output_tokens, self.clock())

    def _admit(self, tenant, request_id, prompt_tokens, lim, now) -> str | None:
        raise NotImplementedError

    def _finish(self, tenant, request_id, output_tokens, now) -> None:
        raise NotImplementedError


def merge_tenants(
    yaml_section: Mapping[str, Any] | None, key_file: Mapping[str, Mapping[str, Any]], key_file_name: str
) -> dict[str, TenantLimits]:
    """The tenants of the YAML `tenants:` section and of the key file's `FIELD=VALUE` words, one
    mapping: each source checked on its own (its errors name it), then merged tenant by tenant.
    A field both give, with different values, is refused naming the tenant, the field and both
    sources: the operator says which one holds. A tenant only the key file names, with no
    fields, is not added (it keeps the defaults either way)."""
    parse_tenants(yaml_section)
    parse_tenants({t: f for t, f in key_file.items() if f}, where=f"{key_file_name}: tenants")
    merged: dict[str, dict[str, Any]] = {t: dict(f or {}) for t, f in (yaml_section or {}).items()}
    for tenant, given in key_file.items():
        if not given:
            continue
        mine = merged.setdefault(tenant, {})
        for name, value in given.items():
            if name in mine and mine[name] != value:
                raise ValueError(
                    f"tenants.{tenant}.{name} is {mine[name]!r} in tenants: and {value!r} in {key_file_name}; "
                    "give it in one place"
                )
            mine[name] = value
    return parse_tenants(merged)


def _refusal(tenant: str, lim: TenantLimits, verdict: str, now: float) -> RateLimited:
    if verdict == "requests_per_s":
        return RateLimited(
            tenant,
            verdict,
            f"tenant {tenant} is over its limit of {lim.requests_per_s:g} requests per second",
            max(0.001, (math.floor(now / lim.request_window_s) + 1) * lim.request_window_s - now),
        )
    if verdict == "tokens_per_min":
        return RateLimited(
            tenant,
            verdict,
            f"tenant {tenant} is over its limit of {lim.tokens_per_min} tokens per minute",
            max(0.001, (math.floor(now / 60) + 1) * 60 - now),
        )
    return RateLimited(
        tenant, verdict, f"tenant {tenant} has its limit of {lim.concurrent} requests in flight already", 1.0
    )


class LocalLimiter(Limiter):
    """The windows in this process (one router replica, or a cluster without Redis)."""

    def __init__(self, limits: Mapping[str, TenantLimits], clock: Callable[[], float] = time.time) -> None:
        super().__init__(limits, clock)
        self._lock = threading.Lock()
        self._second: dict[str, tuple[int, int]] = {}  # tenant -> (second, requests in it)
        self._minute: dict[str, tuple[int, int]] = {}  # tenant -> (minute, tokens in it)
        self._flight: dict[str, set[str]] = {}  # tenant -> request ids in flight

    def _admit(self, tenant, request_id, prompt_tokens, lim, now) -> str | None:
        sec, minute = int(now // lim.request_window_s), int(now // 60)
        with self._lock:
            s_at, s_n = self._second.get(tenant, (sec, 0))
            s_n = s_n if s_at == sec else 0
            m_at, m_n = self._minute.get(tenant, (minute, 0))
            m_n = m_n if m_at == minute else 0
            flight = self._flight.setdefault(tenant, set())
            if lim.requests_per_s is not None and s_n + 1 > lim.requests_per_window + 1e-9:
                return "requests_per_s"
            if lim.tokens_per_min is not None and m_n >= lim.tokens_per_min:
                return "tokens_per_min"
            if lim.concurrent is not None and len(flight) >= lim.concurrent:
                return "concurrent"
            self._second[tenant] = (sec, s_n + 1)
            self._minute[tenant] = (minute, m_n + prompt_tokens)
            flight.add(request_id)
        return None

    def _finish(self, tenant, request_id, output_tokens, now) -> None:
        minute = int(now // 60)
        with self._lock:
            self._flight.get(tenant, set()).discard(request_id)
            m_at, m_n = self._minute.get(tenant, (minute, 0))
            self._minute[tenant] = (minute, (m_n if m_at == minute else 0) + output_tokens)


# KEYS: the tenant's request window, minute and in-flight keys. ARGV: limits (requests per
# window, tokens per minute, in flight; -1 for none), the prompt's tokens, the request id, now,
# the in-flight deadline, the request window's key lifetime (s). Returns "" when admitted, else the limit it is over.
_ADMIT = """
local rps, tpm, conc = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local now = tonumber(ARGV[6])
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
if rps >= 0 and tonumber(redis.call('GET', KEYS[1]) or '0') + 1 > rps then return 'requests_per_s' end
if tpm >= 0 and tonumber(redis.call('GET', KEYS[2]) or '0') >= tpm then return 'tokens_per_min' end
if conc >= 0 and redis.call('ZCARD', KEYS[3]) >= conc then return 'concurrent' end
redis.call('INCR', KEYS[1])
redis.call('EXPIRE', KEYS[1], ARGV[8])
redis.call('INCRBY', KEYS[2], ARGV[4])
redis.call('EXPIRE', KEYS[2], 120)
redis.call('ZADD', KEYS[3], ARGV[7], ARGV[5])
redis.call('EXPIRE', KEYS[3], math.ceil(tonumber(ARGV[7]) - now) + 1)
return ''
"""

_FINISH = """
redis.call('ZREM', KEYS[2], ARGV[1])
if tonumber(ARGV[2]) > 0 then
  redis.call('INCRBY', KEYS[1], ARGV[2])
  redis.call('EXPIRE', KEYS[1], 120)
end
return 1
"""


class RedisLimiter(Limiter):
    """The windows in Redis, shared by every router replica of the cluster (key prefix
    `{cluster}:limits:`); the clock is the routers' (their clocks agree to well under a
    second on one cluster)."""

    def __init__(
        self,
        client: Any,
        cluster: str,
        limits: Mapping[str, TenantLimits],
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(limits, clock)
        self.client = client  # a redis.Redis
        self.prefix = f"{cluster}:limits:"
        self._admit_script = client.register_script(_ADMIT)
        self._finish_script = client.register_script(_FINISH)

    def _keys(self, tenant: str, now: float, window_s: float = 1.0) -> tuple[str, str, str]:
        p = f"{self.prefix}{tenant}:"
        return f"{p}s:{int(now // window_s)}", f"{p}m:{int(now // 60)}", f"{p}flight"

    def _admit(self, tenant, request_id, prompt_tokens, lim, now) -> str | None:
        none = -1
        args = [
            none if lim.requests_per_s is None else lim.requests_per_window + 1e-9,
            none if lim.tokens_per_min is None else lim.tokens_per_min,
            none if lim.concurrent is None else lim.concurrent,
            prompt_tokens,
            request_id,
            now,
            now + HELD_S,
            math.ceil(lim.request_window_s) + 1,
        ]
        got = self._admit_script(keys=list(self._keys(tenant, now, lim.request_window_s)), args=args)
        got = got.decode() if isinstance(got, bytes) else got
        return got or None

    def _finish(self, tenant, request_id, output_tokens, now) -> None:
        _, minute, flight = self._keys(tenant, now)
        self._finish_script(keys=[minute, flight], args=[request_id, output_tokens])
