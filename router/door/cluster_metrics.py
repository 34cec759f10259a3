"""Metrics read at scrape time: the groups' status and the prefix index's health, as this router
sees them, and the timing of the router's round trips to the index.

Every router of a cluster reports every group's series (the same group's values from each
router agree up to the moment each read them): a dashboard takes `max by (group)` of them, not
their sum. A group's counters (prefix cache queries and hits, preemptions, restarts) are its
own since its start; a replacement starts them again, which Prometheus' rate() reads as a
counter reset.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from cluster.index import IndexHealth, IndexReader, InventoryStats, Matches
from worker.kv_events import DEVICE, DISK, HOST

P = "pagefleet:"


class GroupCollector(Collector):
    """Per-group gauges and counters from the groups' status, read at scrape time."""

    def __init__(
        self, model_name: str, statuses: Callable[[], Sequence], tenant_label: Callable[[str], str | None] | None = None
    ) -> None:
        self.model_name = model_name
        self.statuses = statuses
        # a tenant's label ("other" for a name no configuration gave: the series stay bounded)
        self.tenant_label = tenant_label or (lambda t: t)

    def collect(self) -> Iterable[Metric]:
        g, gd = ["model_name", "group"], ["model_name", "group", "device"]
        fams = {
            "running": GaugeMetricFamily(f"{P}num_requests_running", "Requests in a group's running batch.", labels=g),
            "waiting": GaugeMetricFamily(f"{P}num_requests_waiting", "Requests waiting in a group's queue.", labels=g),
            "usage": GaugeMetricFamily(
                f"{P}kv_cache_usage_perc", "Fraction of a group's KV blocks in use (0-1).", labels=g
            ),
            "used": GaugeMetricFamily(
                f"{P}kv_cache_blocks_used",
                "KV blocks referenced by requests, per device of a group.",
                labels=gd,
            ),
            "free": GaugeMetricFamily(
                f"{P}kv_cache_blocks_free",
                "Unreferenced KV blocks (empty or evictable), per device.",
                labels=gd,
            ),
            "alive": GaugeMetricFamily(f"{P}group_alive", "1 while the group is alive.", labels=g),
            "draining": GaugeMetricFamily(
                f"{P}group_draining",
                "1 while the group is draining (alive, taking no new request).",
                labels=g,
            ),
            "queries": CounterMetricFamily(
                f"{P}prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", labels=g
            ),
            "hits": CounterMetricFamily(
                f"{P}prefix_cache_hits", "Prompt tokens served from the prefix cache.", labels=g
            ),
            "preempt": CounterMetricFamily(f"{P}num_preemptions", "Requests preempted (recomputed later).", labels=g),
            "restarts": CounterMetricFamily(f"{P}group_restarts", "Times the supervisor replaced the group.", labels=g),
        }
        gt = [*g, "tenant"]
        tenant_fams = {
            "blocks": GaugeMetricFamily(
                f"{P}tenant_kv_cache_blocks", "A tenant's cached KV blocks on a group's devices.", labels=gt
            ),
            "bytes": GaugeMetricFamily(
                f"{P}tenant_kv_cache_bytes", "Bytes of a tenant's cached KV blocks, per device.", labels=gt
            ),
            "evictions_caused": CounterMetricFamily(
                f"{P}tenant_kv_evictions_caused", "Cached KV blocks a tenant's requests evicted.", labels=gt
            ),
            "evictions_suffered": CounterMetricFamily(
                f"{P}tenant_kv_evictions_suffered", "A tenant's cached KV blocks evicted.", labels=gt
            ),
        }
        gtt = [*gt, "tier"]
        tier_fams = {  # (the host and disk tiers' figures, where the groups give them quotas)
            "blocks": GaugeMetricFamily(
                f"{P}tenant_kv_tier_blocks", "A tenant's KV blocks in a tier under the devices.", labels=gtt
            ),
            "bytes": GaugeMetricFamily(
                f"{P}tenant_kv_tier_bytes", "Bytes of a tenant's KV blocks in a tier, per device.", labels=gtt
            ),
            "evictions_caused": CounterMetricFamily(
                f"{P}tenant_kv_tier_evictions_caused", "A tier's KV blocks a tenant's blocks evicted.", labels=gtt
            ),
            "evictions_suffered": CounterMetricFamily(
                f"{P}tenant_kv_tier_evictions_suffered", "A tenant's KV blocks a tier evicted.", labels=gtt
            ),
        }
        for s in self.statuses():
            lab = [self.model_name, s.group_id]
            used = s.blocks_total - s.blocks_free
            fams["running"].add_metric(lab, s.running)
            fams["waiting"].add_metric(lab, s.waiting)
            fams["usage"].add_metric(lab, used / s.blocks_total if s.blocks_total else 0.0)
            fams["alive"].add_metric(lab, 1.0 if s.alive else 0.0)
            fams["draining"].add_metric(lab, 1.0 if s.draining else 0.0)
            fams["queries"].add_metric(lab, s.prefix_cache_queries)
            fams["hits"].add_metric(lab, s.prefix_cache_hits)
            fams["preempt"].add_metric(lab, s.preemptions)
            fams["restarts"].add_metric(lab, s.restarts)
            for device in s.devices:  # every device of a group shares one block table
                fams["used"].add_metric([*lab, device], used)
                fams["free"].add_metric([*lab, device], s.blocks_free)
            by_label: dict[str, dict[str, int]] = {}
            for tenant, figures in getattr(s, "tenant_kv", {}).items():
                into = by_label.setdefault(self.tenant_label(tenant) or "", {})
                for name, value in figures.items():
                    into[name] = into.get(name, 0) + value
            for label, figures in sorted(by_label.items()):
                for name, fam in tenant_fams.items():
                    fam.add_metric([*lab, label], figures.get(name, 0))
                for tier in (HOST, DISK):
                    if f"{tier}_blocks" in figures:
                        for name, fam in tier_fams.items():
                            fam.add_metric([*lab, label, tier], figures[f"{tier}_{name}"])
        return [*fams.values(), *tenant_fams.values(), *tier_fams.values()]


class TierCollector(Collector):
    """Per-group figures of the KV tiers under the device pool (device, host, disk), from the
    groups' status (`GroupStatus.tiers`, the engine's `kv_*` stats): prompt tokens hit by
    tier, bytes moved each way, restore latency, blocks used and held, failed loads, and the
    requests waiting in the loading state while their prefix's blocks are read."""

    def __init__(self, model_name: str, statuses: Callable[[], Sequence]) -> None:
        self.model_name = model_name
        self.statuses = statuses

    def collect(self) -> Iterable[Metric]:
        gt, gd = ["model_name", "group", "tier"], ["model_name", "group", "direction"]
        hits = CounterMetricFamily(f"{P}kv_tier_hit_tokens", "Prompt tokens served from each KV tier.", labels=gt)
        moved = CounterMetricFamily(
            f"{P}kv_tier_moved_bytes", "KV bytes copied between tiers, each way (rank 0's shard).", labels=gd
        )
        load = HistogramMetricFamily(
            f"{P}kv_tier_load_seconds",
            "Restores: host->device copies of a step's loads, disk->host reads of a fetch.",
            labels=gt,
        )
        used = GaugeMetricFamily(f"{P}kv_tier_blocks_used", "KV blocks a tier holds (device: referenced).", labels=gt)
        capacity = GaugeMetricFamily(f"{P}kv_tier_blocks_capacity", "KV blocks a tier can hold.", labels=gt)
        failed = CounterMetricFamily(
            f"{P}kv_tier_load_failures", "Blocks a tier could not read whole (misses, never KV).", labels=gt
        )
        loading = GaugeMetricFamily(
            f"{P}num_requests_loading",
            "Requests waiting for their prefix's KV blocks to be read from the disk tier.",
            labels=["model_name", "group"],
        )
        for s in self.statuses():
            t = s.tiers
            if not t:
                continue
            lab = [self.model_name, s.group_id]
            if t.get(f"kv_{DISK}_blocks_total"):
                loading.add_metric(lab, s.loading)
            below = [m for m in (HOST, DISK) if t.get(f"kv_{m}_blocks_total")]  # the tiers it has
            host_hits, disk_hits = t.get("kv_host_hits", 0), t.get("kv_disk_hits", 0)
            # (every restored block reaches the pool through the host: its hits hold the disk's)
            tier_hits = {DEVICE: s.prefix_cache_hits - host_hits, HOST: host_hits - disk_hits, DISK: disk_hits}
            hits.add_metric([*lab, DEVICE], tier_hits[DEVICE])
            used.add_metric([*lab, DEVICE], s.blocks_total - s.blocks_free)
            capacity.add_metric([*lab, DEVICE], s.blocks_total)
            for tier in below:
                hits.add_metric([*lab, tier], tier_hits[tier])
                used.add_metric([*lab, tier], t.get(f"kv_{tier}_blocks_cached", 0))
                capacity.add_metric([*lab, tier], t[f"kv_{tier}_blocks_total"])
                failed.add_metric([*lab, tier], t.get(f"kv_{tier}_failures", 0))
                if (times := t.get(f"kv_{tier}_load_seconds")) is not None:
                    load.add_metric([*lab, tier], [(_le(b), n) for b, n in times["buckets"]], times["sum"])
            for direction, tier, key in _MOVES:
                if tier in below:
                    moved.add_metric([*lab, direction], t.get(key, 0))
        return [hits, moved, load, used, capacity, failed, loading]


# (direction label, the tier it needs, the engine's stat): bytes of rank 0's shard, which every rank moves alike
_MOVES = (
    ("device_to_host", HOST, "kv_host_bytes_saved"),
    ("host_to_device", HOST, "kv_host_bytes_loaded"),
    ("host_to_disk", DISK, "kv_disk_bytes_written"),
    ("disk_to_host", DISK, "kv_disk_bytes_read"),
)


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)


class IndexCollector(Collector):
    """The prefix index's health as the router's reader knows it (`IndexReader.health`): no
    round trip at scrape time."""

    def __init__(self, model_name: str, index: IndexReader) -> None:
        self.model_name = model_name
        self.index = index

    def collect(self) -> Iterable[Metric]:
        h: IndexHealth = self.index.health()
        m, backend = [self.model_name], "redis" if h.shared else "memory"
        up = GaugeMetricFamily(
            f"{P}prefix_index_up",
            "1 while the router's prefix index answers (Redis reachable; always 1 in process).",
            labels=["model_name", "backend"],
        )
        up.add_metric([*m, backend], 1.0 if h.reachable else 0.0)
        fams = [up]
        for name, value, text in (
            (
                "entries",
                h.entries,
                "(group, block) entries of live groups in the router's index.",
            ),
            (
                "blocks",
                h.blocks,
                "Distinct KV blocks held by some group, as the router sees them.",
            ),
            ("groups", h.groups, "Live groups registered in the router's prefix index."),
        ):
            fam = GaugeMetricFamily(f"{P}prefix_index_{name}", text, labels=["model_name"])
            fam.add_metric(m, value)
            fams.append(fam)
        if h.mirror_lag_s is not None:
            lag = GaugeMetricFamily(
                f"{P}prefix_index_mirror_lag_seconds",
                "Seconds since the router's mirror of Redis last read the index's change log.",
                labels=["model_name"],
            )
            lag.add_metric(m, h.mirror_lag_s)
            fams.append(lag)
        return fams


class DocumentCollector(Collector):
    """Each tenant's live documents and the blocks this router's groups hold pinned for them
    (router/documents.py: Documents.by_tenant), read at scrape time."""

    def __init__(
        self,
        model_name: str,
        by_tenant: Callable[[], dict[str, tuple[int, int]]],
        tenant_label: Callable[[str], str | None] | None = None,
    ) -> None:
        self.model_name = model_name
        self.by_tenant = by_tenant
        self.tenant_label = tenant_label or (lambda t: t)

    def collect(self) -> Iterable[Metric]:
        labels = ["model_name", "tenant"]
        docs = GaugeMetricFamily(
            f"{P}tenant_documents", "A tenant's live documents (pinned or being pinned).", labels=labels
        )
        pinned = GaugeMetricFamily(
            f"{P}tenant_pinned_blocks", "KV blocks the groups hold pinned for a tenant's documents.", labels=labels
        )
        totals: dict[str, list[int]] = {}
        for tenant, (n, blocks) in self.by_tenant().items():
            label = self.tenant_label(tenant) or "default"
            row = totals.setdefault(label, [0, 0])
            row[0], row[1] = row[0] + n, row[1] + blocks
        for label, (n, blocks) in sorted(totals.items()):
            docs.add_metric([self.model_name, label], n)
            pinned.add_metric([self.model_name, label], blocks)
        return [docs, pinned]


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

    def health(self) -> IndexHealth:
        return self.inner.health()

    def close(self) -> None:
        self.inner.close()
