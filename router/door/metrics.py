"""Prometheus metrics of a router process, named like vLLM's so that its dashboards carry over.

Every series is `pagefleet:<vLLM's name>` with vLLM's meaning, unit and histogram buckets where
vLLM has one (`vllm:time_to_first_token_seconds` -> `pagefleet:time_to_first_token_seconds`,
...); the label `model_name` is vLLM's, and `group` takes the place of vLLM's `engine`.

A request is observed by a `RequestObserver` from the door's receipt of the call to its end:
- time to first token: from the door's receipt to the first token reaching the door (so it
  holds tokenization, routing, the group's queue and the prefill, as vLLM's frontend measures);
- inter-token latency, and a request's decode time (their sum), on the sampling group's clock
  (the door's for the gap across a resume); queue time (arrival to first scheduled) and prefill
  time (first scheduled to first token) on the group's clock; inference = prefill + decode;
  time per output token = decode / (generated tokens - 1);
- `prompt_tokens` advances when a prompt's prefill ends (its first token), `generation_tokens`
  as each token reaches the door;
- every request that reached the router ends exactly once: in `request_success` by finish
  reason (stop, length, abort) or in `request_errors` by status code (CANCELLED,
  DEADLINE_EXCEEDED, UNAVAILABLE, RESOURCE_EXHAUSTED, ...), with its end-to-end latency and
  token counts observed then. A call refused before it reached the router (bad input, no key,
  not ready) counts in `request_errors` alone;
- a request resumed on another group after its group died is still one request (each of its
  tokens counted once), and counts once more in `request_resumes` per resume.
Each placement's predicted and actual cached tokens are counted per group when its first
output comes, beside the prompt tokens placed, so a router's predicted hit rate can be held
against the actual one; and again by tier (`tier`: device, host, disk, pull), so that a
prediction of a device hit served by a restore, or of a pull that did not come, shows. The per-group series and the prefix index's health are read at scrape
time (router/door/cluster_metrics.py); process_* and python_* are prometheus_client's.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Sequence
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import (
    CollectorRegistry,
    Counter,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    make_wsgi_app,
)
from prometheus_client.exposition import ThreadingWSGIServer

from cluster.index import IndexReader
from router.door.cluster_metrics import DocumentCollector, GroupCollector, IndexCollector, TierCollector, TimedReader

# vLLM's buckets (vllm/v1/metrics/loggers.py), so histograms compare bucket for bucket.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
# Queue and prefill times are short on an idle cluster: vLLM's request buckets start at 0.3 s
# and would put them all in the first one, so they take the TTFT buckets.
PHASE_BUCKETS = TTFT_BUCKETS
# Routing and index round trips are sub-millisecond in process, milliseconds over Redis.
FAST_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)

P = "pagefleet:"


def token_buckets(max_model_len: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `max_model_len` (vLLM's build_1_2_5_buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return out
            out.append(m * scale)
        scale *= 10


class ServerMetrics:
    """The metrics of one router process, in a registry of its own (several servers may share a
    process, as in tests)."""

    def __init__(self, model_name: str, max_model_len: int = 32768, registry: CollectorRegistry | None = None) -> None:
        self.model_name = model_name
        self.registry = registry or CollectorRegistry()
        r, m = self.registry, ["model_name"]
        tokens = token_buckets(max_model_len)
        # ---- latency (module docstring: where each starts and ends) ----
        self.ttft = Histogram(
            f"{P}time_to_first_token_seconds",
            "Time to first token, from the door's receipt of the call.",
            m,
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            f"{P}inter_token_latency_seconds",
            "Time between consecutive output tokens of a request.",
            m,
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            f"{P}request_time_per_output_token_seconds",
            "A request's decode time over its output tokens after the first.",
            m,
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            f"{P}e2e_request_latency_seconds",
            "From the door's receipt of the call to the request's end.",
            m,
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        self.queue = Histogram(
            f"{P}request_queue_time_seconds",
            "Time a request waited in its group's queue before its first step.",
            m,
            buckets=PHASE_BUCKETS,
            registry=r,
        )
        self.prefill = Histogram(
            f"{P}request_prefill_time_seconds",
            "From a request's first step to its first token.",
            m,
            buckets=PHASE_BUCKETS,
            registry=r,
        )
        self.decode = Histogram(
            f"{P}request_decode_time_seconds",
            "From a request's first token to its last.",
            m,
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        self.inference = Histogram(
            f"{P}request_inference_time_seconds",
            "From a request's first step to its last token (prefill + decode).",
            m,
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        # ---- tokens and outcomes ----
        self.prompt_tokens = Counter(
            f"{P}prompt_tokens", "Prompt tokens prefilled (counted at each request's first token).", m, registry=r
        )
        self.generation_tokens = Counter(
            f"{P}generation_tokens", "Generated tokens (counted as each reaches the door).", m, registry=r
        )
        self.prompt_hist = Histogram(
            f"{P}request_prompt_tokens", "Prompt tokens per request.", m, buckets=tokens, registry=r
        )
        self.generation_hist = Histogram(
            f"{P}request_generation_tokens", "Generated tokens per request.", m, buckets=tokens, registry=r
        )
        self.success = Counter(
            f"{P}request_success",
            "Requests that ended with a finish reason (stop, length, abort).",
            [*m, "finished_reason"],
            registry=r,
        )
        self.errors = Counter(
            f"{P}request_errors",
            "Requests and calls that ended with an error, by gRPC status code.",
            [*m, "code"],
            registry=r,
        )
        # ---- per tenant (the tenants named in `tenants`; any other as "other") ----
        self.tenants: frozenset[str] = frozenset()  # API keys' tenants and configured ones
        self.tenant_requests = Counter(
            f"{P}tenant_requests",
            "Requests that ended, by tenant and outcome (a finish reason or an error code).",
            [*m, "tenant", "outcome"],
            registry=r,
        )
        self.tenant_tokens = Counter(
            f"{P}tenant_tokens", "Prompt and generated tokens by tenant.", [*m, "tenant", "kind"], registry=r
        )
        self.tenant_ttft = Histogram(
            f"{P}tenant_time_to_first_token_seconds",
            "Time to first token by tenant, from the door's receipt of the call.",
            [*m, "tenant"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.tenant_queue = Histogram(
            f"{P}tenant_queue_time_seconds",
            "Time a tenant's requests waited in a group's queue.",
            [*m, "tenant"],
            buckets=PHASE_BUCKETS,
            registry=r,
        )
        self.tenant_refusals = Counter(
            f"{P}tenant_refusals",
            "Requests refused for a tenant's limit (router/door/limits.py), by tenant and limit.",
            [*m, "tenant", "limit"],
            registry=r,
        )
        self.resumes = Counter(
            f"{P}request_resumes",
            "Times a request moved to another group after its group died mid-stream (once per move).",
            m,
            registry=r,
        )
        # ---- routing ----
        self.routing = Counter(
            f"{P}routing_decisions", "Placements by group and reason.", [*m, "group", "reason"], registry=r
        )
        self.decision = Histogram(
            f"{P}routing_decision_seconds",
            "Time to choose a group (index match + policy).",
            m,
            buckets=FAST_BUCKETS,
            registry=r,
        )
        self.index_rtt = Histogram(
            f"{P}prefix_index_round_trip_seconds",
            "Round trips of the router to the prefix index.",
            [*m, "operation"],
            buckets=FAST_BUCKETS,
            registry=r,
        )
        g = [*m, "group"]
        self.routed_prompt = Counter(
            f"{P}routed_prompt_tokens",
            "Prompt tokens of this router's placements, counted at their first output.",
            g,
            registry=r,
        )
        self.predicted_cached = Counter(
            f"{P}predicted_cached_tokens",
            "Prompt tokens this router predicted cached on the group it chose.",
            g,
            registry=r,
        )
        self.actual_cached = Counter(
            f"{P}actual_cached_tokens", "Prompt tokens the chosen group served from its prefix cache.", g, registry=r
        )
        # the same two by tier (worker/outputs.py: CachedTiers): device hits, host and disk
        # restores, blocks pulled from another group; each sums to the series above
        self.predicted_tier = Counter(
            f"{P}predicted_cached_tier_tokens",
            "Prompt tokens this router predicted cached on the group it chose, by tier.",
            [*g, "tier"],
            registry=r,
        )
        self.actual_tier = Counter(
            f"{P}actual_cached_tier_tokens",
            "Prompt tokens the chosen group served from its prefix cache, by the tier they came from.",
            [*g, "tier"],
            registry=r,
        )
        # Every series exists from the start, at zero (as vLLM's do): a rate over a counter that
        # appears with its first event would miss that event, and a dashboard would show no
        # data where the truth is zero.
        for family in (
            self.ttft,
            self.itl,
            self.tpot,
            self.e2e,
            self.queue,
            self.prefill,
            self.decode,
            self.inference,
            self.prompt_tokens,
            self.generation_tokens,
            self.prompt_hist,
            self.generation_hist,
            self.resumes,
            self.decision,
        ):
            family.labels(model_name)
        for reason in ("stop", "length", "abort"):
            self.success.labels(model_name, reason)
        # ---- the process (prometheus_client's own collectors, in this registry) ----
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)

    def watch_groups(self, statuses: Callable[[], Sequence]) -> None:
        """Export per-group gauges and counters read from `statuses()` (GroupStatus list)."""
        self.registry.register(GroupCollector(self.model_name, statuses, self.tenant_label))
        self.registry.register(TierCollector(self.model_name, statuses))

    def watch_documents(self, by_tenant: Callable[[], dict[str, tuple[int, int]]]) -> None:
        """Export each tenant's documents and pinned blocks (`by_tenant()`: tenant -> both)."""
        self.registry.register(DocumentCollector(self.model_name, by_tenant, self.tenant_label))

    def watch_index(self, index: IndexReader) -> None:
        """Export the prefix index's health as the router's reader sees it."""
        self.registry.register(IndexCollector(self.model_name, index))

    def timed_index(self, index: IndexReader) -> IndexReader:
        """`index` with the router's round trips (match, record_pending) timed."""
        return TimedReader(
            index,
            self.index_rtt.labels(self.model_name, "match"),
            self.index_rtt.labels(self.model_name, "record_pending"),
        )

    def request(self, received: float, tenant: str = "") -> RequestObserver:
        """The observer of one request the door received at `received` (time.perf_counter),
        of `tenant` ("": none named)."""
        return RequestObserver(self, received, tenant)

    def tenant_label(self, tenant: str) -> str | None:
        """The label a tenant's series carry: its name when known, "other" for a name no key
        or configuration gave (names are the callers' to choose: their series stay bounded)."""
        if not tenant:
            return None
        return tenant if tenant in self.tenants else "other"

    def observe_error(self, code_name: str) -> None:
        """A call refused before it reached the router (a request's own end is its observer's)."""
        self.errors.labels(self.model_name, code_name).inc()

    def refused(self, tenant: str, limit: str) -> None:
        """A request of `tenant` refused for `limit` (its error is counted by its observer)."""
        self.tenant_refusals.labels(self.model_name, self.tenant_label(tenant) or "", limit).inc()


class RequestObserver:
    """One request's metrics, from the door's receipt to its end, observed once however it
    ends (see the module docstring for what each measures)."""

    def __init__(self, metrics: ServerMetrics, received: float, tenant: str = "") -> None:
        self.m = metrics
        self.received = received  # the door's clock (time.perf_counter)
        self.tenant = metrics.tenant_label(tenant)  # None: no tenant named
        self.record = None  # the request's RouteRecord (one, updated when the request moves)
        self.placements = 0  # placements whose outputs arrived: the first, then one per resume
        self.measured = 0  # the placement whose cached tokens were counted
        self.tokens = 0  # generated tokens counted so far
        self.prompt_len: int | None = None
        self.queue_s: float | None = None
        self.prefill_s: float | None = None
        self.decode_s = 0.0
        self.last = None  # (placement, group clock, door clock) of the latest token
        self.done = False

    def placed(self, record) -> None:
        """A placement of the request (its first, or a resume's after its group died)."""
        name = self.m.model_name
        self.m.routing.labels(name, record.group_id, record.reason).inc()
        self.m.decision.labels(name).observe(record.decision_seconds)
        if self.tokens:
            self.m.resumes.labels(name).inc()
        self.record = record
        self.placements += 1

    def output(self, out) -> None:
        """A `RequestOutput` (worker/outputs.py) of the current placement."""
        now = time.perf_counter()
        if self.record is not None and self.measured != self.placements:
            self._count_cached(out)
        new = len(out.new_token_ids)  # (a resumed request's earlier tokens are not new)
        if new > 0:
            if self.last is None:
                self._first_token(out, now)
            else:
                self._next_token(out, now)
            self.last = (self.placements, out.token_time, now)
            self.tokens += new
            self.m.generation_tokens.labels(self.m.model_name).inc(new)
            if self.tenant is not None:
                self.m.tenant_tokens.labels(self.m.model_name, self.tenant, "generation").inc(new)
        if out.finished:
            self.finish(out.finish_reason or "unknown")

    def _count_cached(self, out) -> None:
        r, name = self.record, self.m.model_name
        if r.actual_cached_tokens is None:
            return  # (set by the router with the placement's first output)
        self.measured = self.placements
        self.m.routed_prompt.labels(name, r.group_id).inc(len(out.prompt_token_ids))
        self.m.predicted_cached.labels(name, r.group_id).inc(r.predicted_cached_tokens)
        self.m.actual_cached.labels(name, r.group_id).inc(r.actual_cached_tokens)
        for tier, n in r.predicted_tiers.as_dict().items():
            self.m.predicted_tier.labels(name, r.group_id, tier).inc(n)
        if r.actual_tiers is not None:
            for tier, n in r.actual_tiers.as_dict().items():
                self.m.actual_tier.labels(name, r.group_id, tier).inc(n)

    def _first_token(self, out, now: float) -> None:
        name, em = self.m.model_name, out.metrics
        self.m.ttft.labels(name).observe(now - self.received)
        self.prompt_len = len(out.prompt_token_ids)
        self.m.prompt_tokens.labels(name).inc(self.prompt_len)
        if self.tenant is not None:
            self.m.tenant_ttft.labels(name, self.tenant).observe(now - self.received)
            self.m.tenant_tokens.labels(name, self.tenant, "prompt").inc(self.prompt_len)
        self.queue_s = em.queue_time
        if em.first_token_time is not None and em.first_scheduled_time is not None:
            self.prefill_s = em.first_token_time - em.first_scheduled_time

    def _next_token(self, out, now: float) -> None:
        placement, group_time, door_time = self.last
        same_clock = placement == self.placements and None not in (group_time, out.token_time)
        gap = out.token_time - group_time if same_clock else now - door_time
        self.m.itl.labels(self.m.model_name).observe(gap)
        self.decode_s += gap

    def finish(self, reason: str) -> None:
        """The request ended with a finish reason (stop, length, abort)."""
        if not self.done:
            self.m.success.labels(self.m.model_name, reason).inc()
            self._end(reason)

    def fail(self, code_name: str) -> None:
        """The request ended with an error status (CANCELLED, UNAVAILABLE, ...)."""
        if not self.done:
            self.m.errors.labels(self.m.model_name, code_name).inc()
            self._end(code_name)

    def _end(self, outcome: str) -> None:
        self.done = True
        m, name = self.m, self.m.model_name
        if self.tenant is not None:
            m.tenant_requests.labels(name, self.tenant, outcome).inc()
            if self.queue_s is not None:
                m.tenant_queue.labels(name, self.tenant).observe(self.queue_s)
        m.e2e.labels(name).observe(time.perf_counter() - self.received)
        m.generation_hist.labels(name).observe(self.tokens)
        if self.prompt_len is not None:
            m.prompt_hist.labels(name).observe(self.prompt_len)
        if self.queue_s is not None:
            m.queue.labels(name).observe(self.queue_s)
        if self.prefill_s is not None:
            m.prefill.labels(name).observe(self.prefill_s)
            m.inference.labels(name).observe(self.prefill_s + self.decode_s)
        if self.tokens:
            m.decode.labels(name).observe(self.decode_s)
        if self.tokens > 1:
            m.tpot.labels(name).observe(self.decode_s / (self.tokens - 1))


class Unobserved:
    """The observer of a door without metrics: observes nothing."""

    def placed(self, record) -> None:
        pass

    def output(self, out) -> None:
        pass

    def finish(self, reason: str) -> None:
        pass

    def fail(self, code_name: str) -> None:
        pass


# What /metrics always answers with: Prometheus' text format. prometheus_client's OpenMetrics
# writer (what a Prometheus server asks for first) turns the ':' of sample names into '_' while
# their HELP and TYPE lines keep it (prometheus/client_python#1177): Prometheus would store none
# of the pagefleet: series under their names. Every Prometheus also accepts this format.
TEXT_FORMAT = "text/plain; version=0.0.4"


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args) -> None:  # noqa: A002  (a scrape is not news)
        pass


def serve_metrics(metrics: ServerMetrics, host: str = "127.0.0.1", port: int = 0):
    """Serve /metrics over HTTP on (host, port), in Prometheus' text format whatever the scraper
    asks for (see TEXT_FORMAT); port 0 picks a free one. Returns the server (its `server_port`
    is the bound port; `shutdown()` stops it)."""
    app = make_wsgi_app(metrics.registry)

    def text_format(environ, start_response):
        environ["HTTP_ACCEPT"] = TEXT_FORMAT
        return app(environ, start_response)

    class Server(ThreadingWSGIServer):
        address_family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]

    server = make_server(host, port, text_format, Server, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server
