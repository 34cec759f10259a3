"""The prefix index's two sides: what a group writes (`IndexWriter`) and what a router reads
(`IndexReader`); `PrefixIndex` is a backend with both (in-process, Redis).

The index says which live worker group holds how long a prefix of a block-hash chain. Groups
publish the KV events of their block managers (worker/kv_events.py) in order, through an
`IndexPublisher` (cluster/index/publisher.py); routers ask `match(chain)` and get, for every
live group, how many leading blocks of the chain it holds, how many leading blocks are pending
on it (placements routers just made). How busy a group is reaches a router by its own status,
not through the index.

Liveness and fencing: `register_group` hands out a new, larger epoch each time; every write
names its (group, epoch) and is refused with `StaleEpochError` unless that pair is the group's
live registration. A process that registers again names the epoch it held, and is refused once
a newer one took over: a fenced-off process stops, it never takes the group back. A group is
live while its heartbeat is younger than `heartbeat_ttl_s`; once it lapses the registration is
dead for good (the group must register again and republish its inventory), so entries of dead
groups and old epochs never match and may be dropped at any time.
All block hashes are the 16-byte chain hashes of worker/hashing.py.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from cluster.index.types import (
    IndexHealth,
    IndexUnavailableError,
    InventoryStats,
    Matches,
    PendingWrite,
    PrefixIndexConfig,
)
from worker.kv_events import KVEvent


class IndexWriter(ABC):
    """A group's side: its registration, its KV events and its liveness."""

    @abstractmethod
    def register_group(self, group_id: str, previous: int | None = None) -> int:
        """Start a new registration of `group_id`; returns its epoch, larger than any before.

        Entries of the group's older epochs never match again. `previous`: the epoch the caller
        held, when it registers again (its heartbeat lapsed, or the index was out of reach);
        StaleEpochError if a later epoch was handed out since, for a newer process of the group
        fenced this one off. None (a new start) always takes over.
        """

    @abstractmethod
    def publish(self, group_id: str, epoch: int, events: Sequence[KVEvent]) -> None:
        """Apply one step's KV events in order; counts as a heartbeat. StaleEpochError if fenced."""

    @abstractmethod
    def heartbeat(self, group_id: str, epoch: int) -> None:
        """Keep the registration live for another TTL. StaleEpochError once it lapsed."""

    @abstractmethod
    def deregister(self, group_id: str, epoch: int) -> None:
        """End the registration and drop its entries; a no-op for a stale epoch."""

    def close(self) -> None:  # noqa: B027  (optional hook)
        """Release connections; the index is unusable afterwards."""


class IndexReader(ABC):
    """A router's side: matches of a chain, and the placements it makes (pending for a while,
    so that a burst of requests for a new prefix does not scatter before its group reports)."""

    # True when calls are as cheap as a dict update (no round trip), so a router need not keep
    # its own copy of its pending placements nor write them in the background.
    in_process: bool = False
    config: PrefixIndexConfig

    @abstractmethod
    def match(self, block_hashes: Sequence[bytes]) -> Matches:
        """For every live group, its leading cached and pending blocks of the chain (and which
        groups may have any: `Matches.touched`)."""

    @abstractmethod
    def record_pending_many(self, writes: Sequence[PendingWrite], ttl_s: float | None = None) -> None:
        """Mark placements pending for `ttl_s` (default: config.pending_ttl_s); each may keep
        its fresh probes' deadline instead of extending it, so a placement stays pending for at
        least half of `ttl_s` and up to `ttl_s`. Redis: one round trip for all."""

    def record_pending(self, group_id: str, block_hashes: Sequence[bytes], ttl_s: float | None = None) -> None:
        """One placement: a batch of one."""
        self.record_pending_many([PendingWrite(group_id, block_hashes)], ttl_s)

    @abstractmethod
    def inventory_stats(self) -> InventoryStats:
        """Entry counts and, where measurable, memory per cached block."""

    def health(self) -> IndexHealth:
        """Reachability and inventory for a router's metrics (read at every scrape). This
        default asks `inventory_stats`: readers that keep a copy answer from it instead."""
        try:
            stats = self.inventory_stats()
        except IndexUnavailableError:
            return IndexHealth(not self.in_process, False, None, 0, 0, 0)
        return IndexHealth(not self.in_process, True, None, stats.entries, stats.blocks, stats.groups)

    def close(self) -> None:  # noqa: B027  (optional hook)
        """Release connections; the index is unusable afterwards."""


class PrefixIndex(IndexWriter, IndexReader):
    """A backend that holds the index itself: both sides, and the sweep of dead groups."""

    @abstractmethod
    def cleanup(self) -> int:
        """Drop the registrations and entries of dead groups; returns how many groups."""
