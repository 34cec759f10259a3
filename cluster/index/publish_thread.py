"""A group's publisher to an index across the network, on a thread of its own: the engine's
thread hands over each step and never waits on the network (a hung Redis once paused every
stream of a group for seconds at a time).

    engine thread     publish_step(events): the step's events join a bounded queue; returns at
                      once
    publisher thread  takes everything queued, hands it to an `IndexPublisher` as one batch,
                      then a heartbeat when due; wakes at least every half heartbeat interval,
                      so it also beats while the engine is in a long step

The index stays exact. Events go out in the order the engine made them. When the inventory must
be republished (the publisher reconnects, or its registration lapsed), the publisher thread asks
the engine's thread for a snapshot, which the engine's thread takes at its next step in place of
everything still queued (the snapshot already reflects it): the events queued after it apply on
top. While the index is out of reach, events are dropped instead of queued, since the resync on
reconnect supersedes them. If the queue would pass `max_queued_events` (the index answers, but
slowly), the engine's thread replaces the queue with a snapshot, published as "clear, then
store these": the index converges to the cache without the engine waiting.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cluster.index.base import IndexWriter
from cluster.index.publisher import IndexPublisher, Inventory, PublisherConfig, by_medium
from worker.kv_events import AllBlocksCleared, BlockStored, KVEvent

logger = logging.getLogger(__name__)

# How long a resync waits for the engine's thread to take a snapshot: a step's worth, and more
# (a long prefill on a CPU); past it the resync fails and is retried with the outage's backoff.
SNAPSHOT_WAIT_S = 30.0


@dataclass(frozen=True)
class _Snapshot:
    """The prefix cache's hashes per medium at one point between two steps; queued events are
    after it."""

    hashes: dict[str, tuple[bytes, ...]]


class PublisherThread:
    """One index's `IndexPublisher`, run on its own thread and fed by the engine's thread."""

    def __init__(
        self,
        index: IndexWriter,
        group_id: str,
        inventory: Callable[[], Inventory],
        config: PublisherConfig | None = None,
        on_fenced: Callable[[], None] | None = None,
    ) -> None:
        """Registers at once (on the calling thread, before the engine runs: `inventory` is
        then called here); afterwards `inventory` is called only from `publish_step`."""
        self._inventory = inventory
        self._cond = threading.Condition()
        self._queue: deque[Sequence[KVEvent] | _Snapshot] = deque()  # a _Snapshot only first
        self._queued = 0  # events in _queue
        self._cut_off = False  # the index is out of reach: drop events until the next snapshot
        self._want_snapshot = False  # a resync waits for one
        self._closing = False
        self.publisher = IndexPublisher(index, group_id, inventory, config, on_fenced=on_fenced)
        self.publisher.inventory = self._await_snapshot
        self._thread = threading.Thread(target=self._run, name=f"{group_id}-publish", daemon=True)
        self._thread.start()

    @property
    def config(self) -> PublisherConfig:
        return self.publisher.config

    @property
    def epoch(self) -> int | None:
        return self.publisher.epoch

    @property
    def fenced(self) -> bool:
        return self.publisher.fenced

    def publish_step(self, events: Sequence[KVEvent]) -> None:
        """The engine's thread, after each step (and while idle): queue the step; never blocks
        on the index."""
        if self.publisher.fenced:
            return
        with self._cond:
            if self._want_snapshot or self._queued + len(events) > self.config.max_queued_events:
                self._take_snapshot()  # it reflects this step's events too
            elif events and not self._cut_off:
                self._queue.append(events)
                self._queued += len(events)
                self._cond.notify()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread, which deregisters the group (best effort) on its way out."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout_s)

    def _take_snapshot(self) -> None:
        # Engine thread, under the lock: the queue's events are all in the cache now.
        self._queue.clear()
        self._queue.append(_Snapshot(by_medium(self._inventory())))
        self._queued = 0
        self._want_snapshot = self._cut_off = False
        self._cond.notify_all()

    def _await_snapshot(self) -> dict[str, tuple[bytes, ...]]:
        """The publisher's inventory (its thread, resyncing): the next snapshot the engine's
        thread takes, or the one already queued first; TimeoutError if none comes."""
        with self._cond:
            if not (self._queue and isinstance(self._queue[0], _Snapshot)):
                self._want_snapshot = True
                got = self._cond.wait_for(
                    lambda: self._closing or (self._queue and isinstance(self._queue[0], _Snapshot)),
                    SNAPSHOT_WAIT_S,
                )
                if not got or self._closing:
                    raise TimeoutError("the engine took no snapshot of its prefix cache")
            return self._queue.popleft().hashes

    def _run(self) -> None:
        pub, cfg = self.publisher, self.publisher.config
        wait_s = cfg.heartbeat_interval_s / 2
        while True:
            with self._cond:
                if not self._queue and not self._closing:
                    self._cond.wait(wait_s)
                if self._closing:
                    break
                items, self._queued = list(self._queue), 0
                self._queue.clear()
            for item in items:
                for event in _as_events(item):
                    pub.sink(event)
            try:
                pub.tick()
            except Exception:  # noqa: BLE001  (e.g. the inventory failed: the thread lives on)
                logger.exception("prefix index: publishing for %s failed", pub.group_id)
            if pub.fenced:
                return
            if not pub.connected:
                with self._cond:  # the resync on reconnect supersedes them
                    self._queue.clear()
                    self._queued, self._cut_off = 0, True
        pub.close()


def _as_events(item: Sequence[KVEvent] | _Snapshot) -> Sequence[KVEvent]:
    """A queued step's events; a snapshot as the events that make the index hold just it."""
    if isinstance(item, _Snapshot):
        return (AllBlocksCleared(), *(BlockStored(h, None, medium) for medium, h in item.hashes.items()))
    return item
