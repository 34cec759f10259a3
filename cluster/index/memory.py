"""The prefix index of one process (the embedded default, and the simulation's).

It answers as the Redis backend does (cluster/index/redis_index.py): pending placements are
kept at the chain's probe positions (cluster/index/probes.py) and cached blocks are counted by
probes, then between the last probe held and the first missed, so a match costs about the same
at any group count and prompt length. Liveness and fencing are the interface's
(cluster/index/base.py), on this process's clock (or a simulated one). Each group's blocks are
kept per medium (device, host, disk), as its KV events name them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from cluster.index.base import PrefixIndex
from cluster.index.copy import CopiedGroup, IndexCopy
from cluster.index.probes import probe_hashes
from cluster.index.types import (
    IndexHealth,
    InventoryStats,
    Matches,
    PendingWrite,
    PrefixIndexConfig,
    StaleEpochError,
    TierInventory,
    check_medium,
    check_name,
)
from worker.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


class InMemoryPrefixIndex(PrefixIndex):
    """The prefix index of one process: an `IndexCopy` (cluster/index/copy.py) under a lock,
    liveness by clock deadlines; see the module docstring."""

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

    def register_group(self, group_id: str, previous: int | None = None) -> int:
        check_name("group_id", group_id)
        with self._lock:
            now = self._clock()
            self._sweep_dead(now)
            last = self._epochs.get(group_id, 0)
            if previous and last > previous:
                raise StaleEpochError(f"register: group {group_id!r} epoch {previous} was fenced off")
            epoch = max(last, previous or 0) + 1
            self._epochs[group_id] = epoch
            self._copy.register(group_id, epoch, now)  # replaces an older registration
            return epoch

    def publish(self, group_id: str, epoch: int, events: Sequence[KVEvent]) -> None:
        with self._lock:
            g = self._live(group_id, epoch)
            for event in events:
                if isinstance(event, BlockStored):
                    self._copy.store(g, event.block_hashes, check_medium(event.medium))
                elif isinstance(event, BlockRemoved):
                    self._copy.remove(g, event.block_hashes, check_medium(event.medium))
                elif isinstance(event, AllBlocksCleared):
                    self._copy.clear(g)
                else:
                    raise TypeError(f"unknown KV event {event!r}")

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

    def record_pending(self, group_id: str, block_hashes: Sequence[bytes], ttl_s: float | None = None) -> None:
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

    def record_pending_many(self, writes: Sequence[PendingWrite], ttl_s: float | None = None) -> None:
        for w in writes:
            self.record_pending(w.group_id, w.block_hashes, ttl_s)

    def cleanup(self) -> int:
        with self._lock:
            return self._sweep_dead(self._clock())

    def snapshot(self, group_id: str) -> tuple[int, frozenset[bytes]] | None:
        """(epoch, device hashes) of the group's live registration; None when not live."""
        with self._lock:
            g = self._copy.groups.get(group_id)
            if g is None or g.deadline <= self._clock():
                return None
            return g.epoch, frozenset(g.inventory)

    def inventory(self, group_id: str) -> TierInventory | None:
        """The group's live registration's hashes per medium; None when not live."""
        with self._lock:
            g = self._copy.groups.get(group_id)
            return None if g is None or g.deadline <= self._clock() else g.tiers()

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
            lower = self._copy.lower_entries(now)
            return InventoryStats(entries=entries, blocks=distinct, groups=len(live), lower_entries=lower)

    def health(self) -> IndexHealth:
        with self._lock:
            entries, blocks, groups = self._copy.live_inventory(self._clock())
        return IndexHealth(False, True, None, entries, blocks, groups)

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
