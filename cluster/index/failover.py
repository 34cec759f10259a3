"""A router's reader that keeps routing when the shared index (Redis) is out of reach.

`FailoverReader` reads the shared index (a router's mirror of Redis) while it answers, and an
in-process index otherwise, with one warning per outage and a retry after a growing wait. The
in-process index is one the groups of this process publish to as well (each group has a
publisher for it beside its publisher for Redis, cluster/index/publisher.py), so it knows where
their blocks are whatever Redis does. When Redis is back, each group's Redis publisher registers
again and republishes its inventory; until the shared index's answer names every group of this
process again, the local index keeps answering.

The in-process index only sees the groups of this process: it is a fallback for one process's
router and groups, not a replacement for a shared index across processes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from cluster.index.base import IndexReader
from cluster.index.memory import InMemoryPrefixIndex
from cluster.index.outage import Outage
from cluster.index.types import (
    IndexHealth,
    IndexUnavailableError,
    InventoryStats,
    Matches,
    PendingWrite,
)

logger = logging.getLogger(__name__)


class FailoverReader(IndexReader):
    """The shared reader while it answers, the local index while it does not."""

    def __init__(
        self,
        shared: IndexReader,
        local: InMemoryPrefixIndex,
        retry_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not retry_s > 0:
            raise ValueError(f"retry_s must be > 0, got {retry_s}")
        self.shared, self.local = shared, local
        self.config = local.config
        self._outage = Outage(logger, "prefix index (shared)", retry_s, retry_s, clock)

    @property
    def shared_up(self) -> bool:
        """Whether the shared index answered the latest call."""
        return self._outage.up

    def match(self, block_hashes: Sequence[bytes]) -> Matches:
        answer = self._shared(lambda: self.shared.match(block_hashes))
        if answer is None or not all(g in answer for g in self.local.live_groups()):
            # Down, or back but without some of this process's groups (their publishers have
            # not registered there again yet): this process's own index knows them all.
            return self.local.match(block_hashes)
        return answer

    def record_pending_many(self, writes: Sequence[PendingWrite], ttl_s: float | None = None) -> None:
        """Both: the local index must know this router's placements when it is asked."""
        self.local.record_pending_many(writes, ttl_s)
        self._shared(lambda: self.shared.record_pending_many(writes, ttl_s))

    def inventory_stats(self) -> InventoryStats:
        answer = self._shared(self.shared.inventory_stats)
        return self.local.inventory_stats() if answer is None else answer

    def health(self) -> IndexHealth:
        """The shared index's, while it answers; else unreachable, with the local inventory
        that routing runs on meanwhile."""
        shared = self.shared.health()
        if shared.reachable and self.shared_up:
            return shared
        local = self.local.health()
        return replace(local, shared=True, reachable=False, mirror_lag_s=shared.mirror_lag_s)

    def close(self) -> None:
        self.shared.close()

    def _shared(self, call: Callable[[], object]) -> object | None:
        """A call on the shared index; None (use the local one) while it is out of reach."""
        if not self._outage.may_retry():
            return None
        try:
            answer = call()
        except IndexUnavailableError as e:
            self._outage.failed(e, "routing continues on this process's own index")
            return None
        self._outage.recovered()
        return answer
