"""Prometheus metrics of the front door, named like vLLM's so that its dashboards carry over.

Every series is `pagefleet:<vLLM's name>` with the same meaning, unit and histogram buckets
where vLLM has one (`vllm:time_to_first_token_seconds` -> `pagefleet:time_to_first_token_seconds`,
...); the label `model_name` is vLLM's, and `group` takes the place of vLLM's `engine` (one
series per worker group). Series of our own: KV blocks used/free per group and device, routing
decisions by reason, the routing decision time and the prefix index's round trips.

Per-request histograms and counters are observed by the server as requests finish; the
per-group gauges and counters are read from the groups' status at scrape time, so they are
never staler than the groups' latest step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from cluster.index import IndexReader, InventoryStats, Matches

# vLLM's buckets (vllm/v1/metrics/loggers.py), so histograms compare bucket for bucket.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
# Routing and index round trips are sub-millisecond in process, milliseconds over Redis.
FAST_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                0.1, 0.25, 1.0)  # fmt: skip

P = "pagefleet:"


class ServerMetrics:
    """The metrics of one server, in a registry of its own (several servers may share a
    process, as in tests)."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.model_name = model_name
        self.registry = registry or CollectorRegistry()
        r, m = self.registry, ["model_name"]
        self.ttft = Histogram(f"{P}time_to_first_token_seconds", "Time to first token, from the engine's receipt of the request.", m, buckets=TTFT_BUCKETS, registry=r)  # fmt: skip
        self.itl = Histogram(f"{P}inter_token_latency_seconds", "Time between consecutive output tokens of a request.", m, buckets=ITL_BUCKETS, registry=r)  # fmt: skip
        self.e2e = Histogram(f"{P}e2e_request_latency_seconds", "Server receipt of the call to the request's last token.", m, buckets=REQUEST_BUCKETS, registry=r)  # fmt: skip
        self.queue = Histogram(f"{P}request_queue_time_seconds", "Time a request waited in its group's queue before its first step.", m, buckets=REQUEST_BUCKETS, registry=r)  # fmt: skip
        self.prompt_tokens = Counter(f"{P}prompt_tokens", "Prompt tokens of finished requests.", m, registry=r)  # fmt: skip
        self.generation_tokens = Counter(f"{P}generation_tokens", "Generated tokens.", m, registry=r)  # fmt: skip
        self.success = Counter(f"{P}request_success", "Finished requests by finish reason.", [*m, "finished_reason"], registry=r)  # fmt: skip
        self.resumes = Counter(f"{P}request_resumes", "Times a stream moved to another group after its group died (each resumed request counted once per move).", m, registry=r)  # fmt: skip
        self.errors = Counter(f"{P}request_errors", "Requests that ended with a gRPC error, by status code.", [*m, "code"], registry=r)  # fmt: skip
        self.routing = Counter(f"{P}routing_decisions", "Placements by group and reason.", [*m, "group", "reason"], registry=r)  # fmt: skip
        self.decision = Histogram(f"{P}routing_decision_seconds", "Time to choose a group (index match + policy).", m, buckets=FAST_BUCKETS, registry=r)  # fmt: skip
        self.index_rtt = Histogram(f"{P}prefix_index_round_trip_seconds", "Round trips of the router to the prefix index.", [*m, "operation"], buckets=FAST_BUCKETS, registry=r)  # fmt: skip

    def watch_groups(self, statuses: Callable[[], Sequence]) -> None:
        """Export per-group gauges and counters read from `statuses()` (GroupStatus list)."""
        self.registry.register(_GroupCollector(self.model_name, statuses))

    def timed_index(self, index: IndexReader) -> IndexReader:
        """`index` with the router's round trips (match, record_pending) timed."""
        return TimedReader(index, self.index_rtt.labels(self.model_name, "match"),
                                self.index_rtt.labels(self.model_name, "record_pending"))  # fmt: skip

    # ---- per request -------------------------------------------------------------------
    def observe_placement(self, group_id: str, reason: str, decision_seconds: float) -> None:
        self.routing.labels(self.model_name, group_id, reason).inc()
        self.decision.labels(self.model_name).observe(decision_seconds)

    def observe_finished(self, output, e2e_seconds: float) -> None:
        """A finished `RequestOutput` (worker/outputs.py) and the server's end-to-end time."""
        name, m = self.model_name, output.metrics
        if m.ttft is not None:
            self.ttft.labels(name).observe(m.ttft)
        if m.queue_time is not None:
            self.queue.labels(name).observe(m.queue_time)
        itl = self.itl.labels(name)
        for gap in m.inter_token_latencies:
            itl.observe(gap)
        self.e2e.labels(name).observe(e2e_seconds)
        self.prompt_tokens.labels(name).inc(len(output.prompt_token_ids))
        self.generation_tokens.labels(name).inc(len(output.token_ids))
        self.success.labels(name, output.finish_reason or "unknown").inc()

    def observe_error(self, code_name: str) -> None:
        self.errors.labels(self.model_name, code_name).inc()


def serve_metrics(metrics: ServerMetrics, host: str = "127.0.0.1", port: int = 0):
    """Serve /metrics over HTTP on (host, port); port 0 picks a free one. Returns the
    server (its `server_port` is the bound port; `shutdown()` stops it)."""
    server, _thread = start_http_server(port, addr=host, registry=metrics.registry)
    return server


class _GroupCollector(Collector):
    """Reads the groups' status at scrape time."""

    def __init__(self, model_name: str, statuses: Callable[[], Sequence]) -> None:
        self.model_name = model_name
        self.statuses = statuses

    def collect(self) -> Iterable[Metric]:
        g = ["model_name", "group"]
        gd = [*g, "device"]
        fams = {
            "running": GaugeMetricFamily(
                f"{P}num_requests_running", "Requests in a group's running batch.", labels=g
            ),  # fmt: skip
            "waiting": GaugeMetricFamily(
                f"{P}num_requests_waiting", "Requests waiting in a group's queue.", labels=g
            ),  # fmt: skip
            "usage": GaugeMetricFamily(
                f"{P}kv_cache_usage_perc", "Fraction of a group's KV blocks in use (0-1).", labels=g
            ),  # fmt: skip
            "used": GaugeMetricFamily(
                f"{P}kv_cache_blocks_used",
                "KV blocks referenced by requests, per device of a group.",
                labels=gd,
            ),  # fmt: skip
            "free": GaugeMetricFamily(
                f"{P}kv_cache_blocks_free",
                "Unreferenced KV blocks (empty or evictable), per device.",
                labels=gd,
            ),  # fmt: skip
            "alive": GaugeMetricFamily(
                f"{P}group_alive", "1 while the group is alive.", labels=g
            ),  # fmt: skip
            "queries": CounterMetricFamily(
                f"{P}prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", labels=g
            ),  # fmt: skip
            "hits": CounterMetricFamily(
                f"{P}prefix_cache_hits", "Prompt tokens served from the prefix cache.", labels=g
            ),  # fmt: skip
            "preempt": CounterMetricFamily(
                f"{P}num_preemptions", "Requests preempted (recomputed later).", labels=g
            ),  # fmt: skip
        }
        for s in self.statuses():
            lab = [self.model_name, s.group_id]
            used = s.blocks_total - s.blocks_free
            fams["running"].add_metric(lab, s.running)
            fams["waiting"].add_metric(lab, s.waiting)
            fams["usage"].add_metric(lab, used / s.blocks_total if s.blocks_total else 0.0)
            fams["alive"].add_metric(lab, 1.0 if s.alive else 0.0)
            fams["queries"].add_metric(lab, s.prefix_cache_queries)
            fams["hits"].add_metric(lab, s.prefix_cache_hits)
            fams["preempt"].add_metric(lab, s.preemptions)
            for device in s.devices:  # every device of a group shares one block table
                fams["used"].add_metric([*lab, device], used)
                fams["free"].add_metric([*lab, device], s.blocks_free)
        return list(fams.values())


class TimedReader(IndexReader):
    """A router's index reader whose round trips (`match`, `record_pending_many`) are timed."""

    def __init__(self, inner: IndexReader, match_hist, pending_hist) -> None:
        self.inner = inner
        self.in_process = inner.in_process
        self.config = inner.config
        self._match_hist = match_hist
        self._pending_hist = pending_hist

    def match(self, block_hashes) -> Matches:
        t0 = time.perf_counter()
        try:
            return self.inner.match(block_hashes)
        finally:
            self._match_hist.observe(time.perf_counter() - t0)

    def record_pending(self, group_id, block_hashes, ttl_s=None) -> None:
        t0 = time.perf_counter()
        try:
            self.inner.record_pending(group_id, block_hashes, ttl_s)
        finally:
            self._pending_hist.observe(time.perf_counter() - t0)

    def record_pending_many(self, writes, ttl_s=None) -> None:
        t0 = time.perf_counter()
        try:
            self.inner.record_pending_many(writes, ttl_s)
        finally:
            self._pending_hist.observe(time.perf_counter() - t0)

    def inventory_stats(self) -> InventoryStats:
        return self.inner.inventory_stats()

    def close(self) -> None:
        self.inner.close()
