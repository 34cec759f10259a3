"""A group's publishers, one per index it writes to, fed each engine step at once: the one way
a group, whatever runs its engine, publishes its KV events and liveness.

Every host of an engine runs the same loop: the engine's KV-event sink is `collect` (called
during a step), and after each step (or idle wake-up) the host calls `after_step()`, which
publishes what was collected. A host whose events arrive in batches from
elsewhere (a Ray group's driver) calls `publish_step` with them directly.

An index in this process (`in_process`: a dict update, no round trip) is fed on the engine's
thread, so that when a caller sees a request finish the index already holds its blocks; a beat
thread keeps it alive through a step longer than its TTL. An index across the network (Redis)
gets a `PublisherThread` (cluster/index/publish_thread.py): the engine's thread never waits on
it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from cluster.index.base import IndexWriter
from cluster.index.publish_thread import PublisherThread
from cluster.index.publisher import IndexPublisher, Inventory, PublisherConfig
from worker.kv_events import KVEvent


class GroupPublisher:
    """A group's publishers (see the module docstring); `publish_step` from one thread."""

    def __init__(
        self,
        indexes: IndexWriter | Sequence[IndexWriter],
        group_id: str,
        inventory: Callable[[], Inventory],
        config: PublisherConfig | None = None,
        on_fenced: Callable[[], None] | None = None,
    ) -> None:
        """`on_fenced`: called (from a publisher's thread) when a newer registration of the
        group fences one of them off: this process no longer serves the group."""
        if isinstance(indexes, IndexWriter):
            indexes = (indexes,)
        self.publishers: list[IndexPublisher | PublisherThread] = [
            IndexPublisher(ix, group_id, inventory, config, on_fenced=on_fenced)
            if getattr(ix, "in_process", False)
            else PublisherThread(ix, group_id, inventory, config, on_fenced)
            for ix in indexes
        ]
        self._local = [p for p in self.publishers if isinstance(p, IndexPublisher)]
        self._collected: list[KVEvent] = []  # this step's events, from the engine's sink
        self._stop = threading.Event()
        self._beats = None
        if self._local:
            self._beats = threading.Thread(target=self._beat, name=f"{group_id}-beat", daemon=True)
            self._beats.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.config.heartbeat_interval_s / 2):
            for p in self._local:
                p.beat()

    @property
    def config(self) -> PublisherConfig:
        return self.publishers[0].config

    @property
    def epoch(self) -> int | None:
        """The first index's registration epoch (None before its first registration)."""
        return self.publishers[0].epoch

    @property
    def fenced(self) -> bool:
        """True once any index fenced this group's registration off."""
        return any(p.fenced for p in self.publishers)

    def publish_step(self, events: Sequence[KVEvent]) -> None:
        for p in self.publishers:
            p.publish_step(events)

    def collect(self, events: Sequence[KVEvent]) -> None:
        """The engine's KV-event sink: keep a step's events until `after_step`."""
        self._collected.extend(events)

    def after_step(self) -> None:
        """Publish what was collected during the step just run (on the engine's thread, after
        every step and idle wake-up)."""
        events, self._collected = self._collected, []
        self.publish_step(events)

    def close(self) -> None:
        """Stop publishing; every index drops the group's entries at once (best effort)."""
        self._stop.set()
        if self._beats is not None:
            self._beats.join(timeout=5)
        for p in self.publishers:
            p.close()
