"""The prefix index: which live worker group holds how long a prefix of a block-hash chain.

Groups publish the KV events of their block managers (worker/kv_events.py) in order; routers
ask `match(chain)` and get, for every live group, how many leading blocks of the chain it holds,
how many leading blocks are pending on it (placements other routers just made), and its latest
load report. Two backends share these semantics: `InMemoryPrefixIndex` (the embedded default,
one process) and `RedisPrefixIndex` (cluster/redis_index.py, shared by every router and group).
Both keep pending placements at the chain's probe positions (cluster/chain_probes.py) and count
cached blocks by probes, then between the last probe held and the first missed.

Liveness and fencing: `register_group` hands out a new, larger epoch each time; every write
names its (group, epoch) and is refused with `StaleEpochError` unless that pair is the group's
live registration. A group is live while its heartbeat is younger than `heartbeat_ttl_s`; once
it lapses the registration is dead for good (the group must register again and republish its
inventory), so entries of dead groups and old epochs never match and may be dropped at any time.
"""

from __future__ import annotations

import re
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cluster.chain_probes import probe_hashes
from cluster.index_copy import CopiedGroup, IndexCopy
from cluster.index_types import GroupLoad, Matches
from worker.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

# Names become parts of Redis keys: no separators, spaces or hash-tag braces.
_NAME = re.compile(r"[A-Za-z0-9_.\-/@+=]{1,128}")


def check_name(field_name: str, value: str) -> str:
    """`value` if it is a usable cluster, model or group name, else ValueError naming the field."""
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise ValueError(f"{field_name} must match {_NAME.pattern}, got {value!r}")
    return value


class PrefixIndexError(Exception):
    """Base of the errors a prefix index raises for reasons outside the caller's arguments."""


class StaleEpochError(PrefixIndexError):
    """The (group, epoch) is not the group's live registration: superseded, expired or gone."""


class IndexUnavailableError(PrefixIndexError):
    """The shared index cannot be reached (Redis down, timed out, refusing writes)."""


@dataclass(frozen=True)
class PrefixIndexConfig:
    """Liveness and pending-placement timing shared by both backends."""

    # A group is dead once this long passes without a heartbeat, publish or load report;
    # three heartbeat intervals tolerate two lost beats.
    heartbeat_ttl_s: float = 3.0
    # A placement shows as pending this long unless record_pending is given its own TTL; long
    # enough for the group to prefill and publish the blocks, short enough to forget failures.
    pending_ttl_s: float = 2.0
    # Keys sampled with MEMORY USAGE by inventory_stats (Redis backend).
    stats_sample_keys: int = 64

    def __post_init__(self) -> None:
        if not self.heartbeat_ttl_s > 0:
            raise ValueError(f"heartbeat_ttl_s must be > 0, got {self.heartbeat_ttl_s}")
        if not self.pending_ttl_s > 0:
            raise ValueError(f"pending_ttl_s must be > 0, got {self.pending_ttl_s}")
        if self.stats_sample_keys < 1:
            raise ValueError(f"stats_sample_keys must be >= 1, got {self.stats_sample_keys}")


@dataclass(frozen=True)
class PendingWrite:
    """One placement for `PrefixIndex.record_pending_many`."""

    group_id: str
    block_hashes: Sequence[bytes]  # the placed chain
    # Leading probes (`probe_positions`) the writer recorded on this group less than half a
    # pending TTL ago: a backend may keep their deadline and write only the rest.
    fresh_probes: int = 0


@dataclass(frozen=True)
class InventoryStats:
    """Size of the index over its live groups."""

    entries: int  # (group, block) pairs
    blocks: int  # distinct block hashes held by at least one group
    groups: int  # live groups
    bytes_per_block: float | None = None  # Redis memory per entry; None in memory
    bytes_total: int | None = None  # Redis memory of all entries (MEMORY USAGE estimate)
    # Redis memory of the change log that routers' mirrors follow (cluster/redis_mirror.py):
    # recent writes, about LOG_MAX_ENTRIES of them, not part of bytes_total.
    log_bytes: int | None = None


class PrefixIndex(ABC):
    """Shared state that lets a router place a request where its prefix is already cached.

    Writers are groups (through cluster/index_publisher.py); readers are routers. All block
    hashes are the 16-byte chain hashes of worker/hashing.py.
    """

    # True when calls are as cheap as a dict update (no round trip), so a router need not keep
    # its own copy of its pending placements nor write them in the background.
    in_process: bool = False

    @abstractmethod
    def register_group(self, group_id: str) -> int:
        """Start a new registration of `group_id`; returns its epoch, larger than any before.

        Entries of the group's older epochs never match again.
        """

    @abstractmethod
    def publish(self, group_id: str, epoch: int, events: Sequence[KVEvent]) -> None:
        """Apply one step's KV events in order; counts as a heartbeat. StaleEpochError if fenced."""

    @abstractmethod
    def report_load(self, group_id: str, epoch: int, load: GroupLoad) -> None:
        """Store the group's latest load; counts as a heartbeat. StaleEpochError if fenced."""

    @abstractmethod
    def heartbeat(self, group_id: str, epoch: int) -> None:
        """Keep the registration live for another TTL. StaleEpochError once it lapsed."""

    @abstractmethod
    def deregister(self, group_id: str, epoch: int) -> None:
        """End the registration and drop its entries; a no-op for a stale epoch."""

    @abstractmethod
    def match(self, block_hashes: Sequence[bytes]) -> Matches:
        """For every live group, its leading cached and pending blocks of the chain (and which
        groups may have any: `Matches.touched`)."""

    @abstractmethod
    def record_pending(
        self, group_id: str, block_hashes: Sequence[bytes], ttl_s: float | None = None
    ) -> None:
        """Mark the chain as pending on the group for `ttl_s` (default: config.pending_ttl_s)."""

    def record_pending_many(
        self, writes: Sequence[PendingWrite], ttl_s: float | None = None
    ) -> None:
        """Several placements at once (Redis: one round trip); each may keep its fresh probes'
        deadline instead of extending it, so a placement stays pending for at least half of
        `ttl_s` and up to `ttl_s`."""
        for w in writes:
            self.record_pending(w.group_id, w.block_hashes, ttl_s)

    @abstractmethod
    def cleanup(self) -> int:
        """Drop the registrations and entries of dead groups; returns how many groups."""

    @abstractmethod
    def inventory_stats(self) -> InventoryStats:
        """Entry counts and, where measurable, memory per cached block."""

    def close(self) -> None:  # noqa: B027  (optional hook)
        """Release connections; the index is unusable afterwards."""


class BatchedPendingIndex(PrefixIndex):
    """A shared index whose pending placements are written in batches: `record_pending` is a
    batch of one. Subclasses implement `record_pending_many`."""

    def record_pending(
        self, group_id: str, block_hashes: Sequence[bytes], ttl_s: float | None = None
    ) -> None:
        self.record_pending_many([PendingWrite(group_id, block_hashes)], ttl_s)

    @abstractmethod
    def record_pending_many(
        self, writes: Sequence[PendingWrite], ttl_s: float | None = None
    ) -> None: ...


class InMemoryPrefixIndex(PrefixIndex):
    """The prefix index of one process: an `IndexCopy` (cluster/index_copy.py) under a lock,
    liveness by clock deadlines. It answers as the Redis backend does: pending placements are
    kept at the chain's probe positions and cached blocks are counted by probes, then the gap,
    so a match costs about the same at any group count and prompt length."""

    in_process = True

    def __init__(
        self,
        config: PrefixIndexConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config or PrefixIndexConfig()
        self._clock = clock
        self._lock = threading.Lock()
        self._epochs: dict[str, int] = {}  # group -> last epoch handed out; never shrinks
        self._copy = IndexCopy(self.config.heartbeat_ttl_s)

    def register_group(self, group_id: str) -> int:
        check_name("group_id", group_id)
        with self._lock:
            now = self._clock()
            self._sweep_dead(now)
            epoch = self._epochs.get(group_id, 0) + 1
            self._epochs[group_id] = epoch
            self._copy.register(group_id, epoch, now)  # replaces an older registration
            return epoch

    def publish(self, group_id: str, epoch: int, events: Sequence[KVEvent]) -> None:
        with self._lock:
            g = self._live(group_id, epoch)
            for event in events:
                if isinstance(event, BlockStored):
                    self._copy.store(g, event.block_hashes)
                elif isinstance(event, BlockRemoved):
                    self._copy.remove(g, event.block_hashes)
                elif isinstance(event, AllBlocksCleared):
                    self._copy.clear(g)
                else:
                    raise TypeError(f"unknown KV event {event!r}")

    def report_load(self, group_id: str, epoch: int, load: GroupLoad) -> None:
        with self._lock:
            self._copy.set_load(group_id, self._live(group_id, epoch), load)

    def heartbeat(self, group_id: str, epoch: int) -> None:
        with self._lock:
            self._live(group_id, epoch)

    def deregister(self, group_id: str, epoch: int) -> None:
        with self._lock:
            g = self._copy.groups.get(group_id)
            if g is not None and g.epoch == epoch:
                self._copy.drop(group_id)

    def match(self, block_hashes: Sequence[bytes]) -> Matches:
        with self._lock:
            return self._copy.match(block_hashes, self._clock())

    def record_pending(
        self, group_id: str, block_hashes: Sequence[bytes], ttl_s: float | None = None
    ) -> None:
        check_name("group_id", group_id)
        ttl = self.config.pending_ttl_s if ttl_s is None else ttl_s
        if not ttl > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        with self._lock:
            now = self._clock()
            g = self._copy.groups.get(group_id)
            if g is not None and g.deadline > now and block_hashes:
                # As a router's writes to Redis: probes pending for over half a TTL more are
                # left as they are (a hot document's questions add their own tails), the rest
                # pending until now + ttl at most; an entry never shortens.
                probed = probe_hashes(block_hashes)
                fresh = self._copy.fresh(g, probed, now + ttl / 2)
                if fresh < len(probed):
                    self._copy.place(g, probed, fresh, ttl, now)

    def cleanup(self) -> int:
        with self._lock:
            return self._sweep_dead(self._clock())

    def snapshot(self, group_id: str) -> tuple[int, frozenset[bytes], GroupLoad | None] | None:
        """(epoch, cached hashes, load) of the group's live registration; None when not live.

        What a failover index republishes into the shared index once it is back."""
        with self._lock:
            g = self._copy.groups.get(group_id)
            if g is None or g.deadline <= self._clock():
                return None
            return g.epoch, frozenset(g.inventory), g.load

    def live_groups(self) -> list[str]:
        with self._lock:
            now = self._clock()
            return [gid for gid, g in self._copy.groups.items() if g.deadline > now]

    def inventory_stats(self) -> InventoryStats:
        with self._lock:
            now = self._clock()
            live = [g for g in self._copy.groups.values() if g.deadline > now]
            entries = sum(len(g.inventory) for g in live)
            distinct = len(set().union(*(g.inventory for g in live)))
            return InventoryStats(entries=entries, blocks=distinct, groups=len(live))

    # Internals; the lock is held.

    def _live(self, group_id: str, epoch: int) -> CopiedGroup:
        """The live registration (group, epoch), its deadline pushed back; else StaleEpochError."""
        g = self._copy.groups.get(group_id)
        now = self._clock()
        if g is None or g.epoch != epoch or g.deadline <= now:
            raise StaleEpochError(f"group {group_id!r} epoch {epoch} is not live")
        self._copy.touch(g, now)
        return g

    def _sweep_dead(self, now: float) -> int:
        dead = [gid for gid, g in self._copy.groups.items() if g.deadline <= now]
        for gid in dead:
            self._copy.drop(gid)
        return len(dead)
