"""A prefix index that keeps the router serving when Redis is down, and converges when it returns.

`FailoverPrefixIndex` wraps the shared Redis index and an in-process one. Every write from this
process's publishers (groups) goes to both; `match` asks Redis while it answers and the
in-process index otherwise, with one warning per outage. Epochs handed to publishers are the
in-process index's; each group's Redis registration is kept alongside. While Redis is down,
every `retry_s` a call tries it again; once it answers, every group this process knows is
registered anew in Redis and its whole inventory (and latest load) republished from the
in-process index, so the shared index converges without the groups doing anything.

The in-process index only sees the groups that publish through this object: it is a fallback
for one process's router and groups, not a replacement for a shared index across processes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from cluster.prefix_index import (
    GroupLoad,
    IndexUnavailableError,
    InMemoryPrefixIndex,
    InventoryStats,
    Matches,
    PendingWrite,
    PrefixIndex,
    PrefixIndexConfig,
    StaleEpochError,
)
from worker.kv_events import BlockStored, KVEvent

logger = logging.getLogger(__name__)


class FailoverPrefixIndex(PrefixIndex):
    """Redis while it answers, the in-process index while it does not; see the module doc."""

    def __init__(
        self,
        shared: PrefixIndex,
        config: PrefixIndexConfig | None = None,
        retry_s: float = 1.0,
        republish_chunk: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not retry_s > 0:
            raise ValueError(f"retry_s must be > 0, got {retry_s}")
        self.shared = shared
        self.local = InMemoryPrefixIndex(config or getattr(shared, "config", None))
        self.config = self.local.config
        self.retry_s = retry_s
        self.republish_chunk = republish_chunk
        self._clock = clock
        self._lock = threading.RLock()
        self._shared_epochs: dict[str, int] = {}  # group -> its registration in `shared`
        self._up = True
        self._retry_at = 0.0

    @property
    def shared_up(self) -> bool:
        """Whether the shared index answered the latest call."""
        return self._up

    # ---- writes: both backends ---------------------------------------------------------
    def register_group(self, group_id: str) -> int:
        epoch = self.local.register_group(group_id)
        self._shared(lambda: self._register_shared(group_id))
        return epoch

    def publish(self, group_id: str, epoch: int, events: Sequence[KVEvent]) -> None:
        self.local.publish(group_id, epoch, events)
        self._per_group(group_id, lambda e: self.shared.publish(group_id, e, events))

    def report_load(self, group_id: str, epoch: int, load: GroupLoad) -> None:
        self.local.report_load(group_id, epoch, load)
        self._per_group(group_id, lambda e: self.shared.report_load(group_id, e, load))

    def heartbeat(self, group_id: str, epoch: int) -> None:
        self.local.heartbeat(group_id, epoch)
        self._per_group(group_id, lambda e: self.shared.heartbeat(group_id, e))

    def deregister(self, group_id: str, epoch: int) -> None:
        self.local.deregister(group_id, epoch)
        with self._lock:
            shared_epoch = self._shared_epochs.pop(group_id, None)
        if shared_epoch is not None:
            self._shared(lambda: self.shared.deregister(group_id, shared_epoch))

    def record_pending(
        self, group_id: str, block_hashes: Sequence[bytes], ttl_s: float | None = None
    ) -> None:
        self.local.record_pending(group_id, block_hashes, ttl_s)
        self._shared(lambda: self.shared.record_pending(group_id, block_hashes, ttl_s))

    def record_pending_many(
        self, writes: Sequence[PendingWrite], ttl_s: float | None = None
    ) -> None:
        self.local.record_pending_many(writes, ttl_s)
        self._shared(lambda: self.shared.record_pending_many(writes, ttl_s))

    def cleanup(self) -> int:
        n = self.local.cleanup()
        self._shared(self.shared.cleanup)
        return n

    # ---- reads: Redis while it answers ---------------------------------------------------
    def match(self, block_hashes: Sequence[bytes]) -> Matches:
        answer = self._shared(lambda: self.shared.match(block_hashes))
        return self.local.match(block_hashes) if answer is None else answer

    def inventory_stats(self) -> InventoryStats:
        answer = self._shared(self.shared.inventory_stats)
        return self.local.inventory_stats() if answer is None else answer

    def close(self) -> None:
        self.shared.close()

    # ---- internals ---------------------------------------------------------------------
    def _shared(self, call: Callable[[], object]) -> object | None:
        """Run a call on the shared index; None (and the fallback) when it is out of reach."""
        with self._lock:
            if not self._up and not self._reconnect():
                return None
            try:
                return call()
            except IndexUnavailableError as e:
                self._down(e)
                return None

    def _per_group(self, group_id: str, call: Callable[[int], None]) -> None:
        """A group's write to the shared index under its shared epoch; a fenced epoch (Redis
        restarted, or the registration lapsed) is healed by registering and republishing."""

        def run() -> None:
            epoch = self._shared_epochs.get(group_id)
            if epoch is None:
                return  # not registered there yet: the resync below covers it
            try:
                call(epoch)
            except StaleEpochError:
                self._register_shared(group_id)

        self._shared(run)

    def _register_shared(self, group_id: str) -> None:
        """Register `group_id` in the shared index and republish what the local index holds."""
        snap = self.local.snapshot(group_id)
        if snap is None:
            return
        _, hashes, load = snap
        epoch = self.shared.register_group(group_id)
        hashes = tuple(hashes)
        step = self.republish_chunk
        for i in range(0, len(hashes), step):
            self.shared.publish(group_id, epoch, [BlockStored(hashes[i : i + step], None)])
        if load is not None:
            self.shared.report_load(group_id, epoch, load)
        self._shared_epochs[group_id] = epoch

    def _reconnect(self) -> bool:
        if self._clock() < self._retry_at:
            return False
        try:
            for group_id in self.local.live_groups():
                self._register_shared(group_id)
        except IndexUnavailableError:
            self._retry_at = self._clock() + self.retry_s
            return False
        self._up = True
        logger.warning(
            "prefix index: shared index is back; republished %d groups", len(self._shared_epochs)
        )
        return True

    def _down(self, error: Exception) -> None:
        if self._up:
            logger.warning(
                "prefix index: shared index unavailable (%s); routing continues on the "
                "in-process index and will republish when it returns",
                error,
            )
        self._up = False
        self._shared_epochs.clear()
        self._retry_at = self._clock() + self.retry_s
