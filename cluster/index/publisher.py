"""The group side of the prefix index: KV events and heartbeats, never failing the engine.

An `IndexPublisher` is fed each engine step's KV events (`publish_step(events)`) from one thread
(it is not thread-safe): a step's events go out as one batch, in order, then a heartbeat when
one is due. A group owns its publishers through a
`GroupPublisher` (cluster/index/group_publisher.py), which feeds an index in this process from
the engine's thread and one across the network from a thread of its own
(cluster/index/publish_thread.py), so that the engine never waits on Redis.

When the index is out of reach the publisher logs one warning, marks itself disconnected and
drops its queue: events are not kept, because on reconnect (tried on later ticks, with
exponential backoff) the publisher registers a new epoch and republishes the group's whole
inventory, which supersedes every event it missed. The same resync happens when the index
refuses the epoch because the heartbeat lapsed. A re-registration names the epoch it held, and
the index refuses it once a newer process of the group has registered (a replacement placed
while this one was cut off): the publisher is then fenced off for good. It stops, never takes
the group back, and tells its owner (`on_fenced`), whose process should end.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from cluster.index.base import IndexWriter
from cluster.index.outage import Outage
from cluster.index.types import (
    IndexUnavailableError,
    PrefixIndexError,
    StaleEpochError,
)
from worker.kv_events import DEVICE, BlockStored, KVEvent

# What a group's `inventory` callable returns: its device pool's hashes, or every medium's
# hashes by name (worker/kv_events.py), so that a republished index holds each tier.
Inventory = Iterable[bytes] | Mapping[str, Iterable[bytes]]


def by_medium(inventory: Inventory) -> dict[str, tuple[bytes, ...]]:
    """An inventory as hashes per medium (a plain iterable is the device's)."""
    if isinstance(inventory, Mapping):
        return {medium: tuple(hashes) for medium, hashes in inventory.items()}
    return {DEVICE: tuple(inventory)}


logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PublisherConfig:
    """How often a group talks to the index, and how it retries."""

    # Must stay well under the index's heartbeat_ttl_s (default 3 s: three beats).
    heartbeat_interval_s: float = 1.0
    retry_initial_s: float = 0.5
    retry_max_s: float = 10.0
    # Blocks per publish when republishing the inventory: bounds one script's run time.
    republish_chunk: int = 4096
    # Events a publisher thread holds for an index out of reach (publish_thread.py); beyond,
    # the engine's thread replaces them with a snapshot of the inventory. 64k events are a few
    # MB and tens of seconds of a busy group's steps.
    max_queued_events: int = 65536

    def __post_init__(self) -> None:
        for name in ("heartbeat_interval_s", "retry_initial_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.retry_max_s < self.retry_initial_s:
            raise ValueError(f"retry_max_s must be >= retry_initial_s, got {self.retry_max_s}")
        if self.republish_chunk < 1:
            raise ValueError(f"republish_chunk must be >= 1, got {self.republish_chunk}")
        if self.max_queued_events < 1:
            raise ValueError(f"max_queued_events must be >= 1, got {self.max_queued_events}")


class IndexPublisher:
    """Publishes one group's KV events and liveness to one prefix index (a group that
    publishes to several, e.g. this process's index and Redis, has one publisher for each)."""

    def __init__(
        self,
        index: IndexWriter,
        group_id: str,
        inventory: Callable[[], Inventory],
        config: PublisherConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_fenced: Callable[[], None] | None = None,
    ) -> None:
        """`inventory` returns the hashes of every block the group's prefix cache holds now,
        the device's alone or every tier's by medium (called on the publishing thread; its
        owner may replace it); `on_fenced` is called once
        when a newer registration of the group fences this publisher off."""
        self.index = index
        self.group_id = group_id
        self.config = config or PublisherConfig()
        self.inventory = inventory
        self._clock = clock
        self._on_fenced = on_fenced
        self._queue: list[KVEvent] = []
        self._epoch: int | None = None
        self._connected = False
        self._fenced = False
        cfg = self.config
        self._outage = Outage(logger, f"prefix index for {group_id}", cfg.retry_initial_s, cfg.retry_max_s, clock)
        self._last_beat = float("-inf")
        self._resync()

    @property
    def connected(self) -> bool:
        return self._connected

    @property
    def epoch(self) -> int | None:
        """The live registration's epoch; None before the first successful registration."""
        return self._epoch

    @property
    def fenced(self) -> bool:
        """True once a newer registration of the group fenced this one off: it publishes no
        more."""
        return self._fenced

    def sink(self, event: KVEvent) -> None:
        """The block manager's KV-event sink; events wait for the next `flush`/`tick`."""
        if self._connected:  # disconnected: the republished inventory will cover it
            self._queue.append(event)

    def publish_step(self, events: Iterable[KVEvent]) -> None:
        """One engine step: its KV events in order, then the tick (how every group feeds its
        publishers, whatever runs its engine)."""
        for event in events:
            self.sink(event)
        self.tick()

    def flush(self) -> None:
        """Publish the queued events as one batch (reconnecting first when it is time)."""
        if not self._ensure_connected() or not self._queue:
            return
        events, self._queue = self._queue, []
        self._call(lambda: self.index.publish(self.group_id, self._epoch, events))

    def tick(self) -> None:
        """Once per engine step: flush, then a heartbeat when one is due."""
        self.flush()
        if not self._connected:
            return
        now = self._clock()
        if now - self._last_beat >= self.config.heartbeat_interval_s:
            self._heartbeat(now)

    def beat(self) -> None:
        """A heartbeat when one is due, from any thread: liveness that does not wait for the
        engine's step. It only refreshes the live registration; a failure is left for the
        step thread's next call to find (and resync), so this thread never races it."""
        epoch, now = self._epoch, self._clock()
        if (
            not self._connected
            or self._fenced
            or epoch is None
            or now - self._last_beat < self.config.heartbeat_interval_s
        ):
            return
        try:
            self.index.heartbeat(self.group_id, epoch)
            self._last_beat = now
        except PrefixIndexError:
            pass

    def close(self) -> None:
        """Deregister (best effort): the group's entries leave the index at once."""
        if self._connected and not self._fenced and self._epoch is not None:
            try:
                self.index.deregister(self.group_id, self._epoch)
            except PrefixIndexError as e:
                logger.info("prefix index: deregistering %s failed: %s", self.group_id, e)
        self._connected = False
        self._queue.clear()

    def _heartbeat(self, now: float) -> None:
        if self._call(lambda: self.index.heartbeat(self.group_id, self._epoch)):
            self._last_beat = now

    def _call(self, fn: Callable[[], None]) -> bool:
        """Run one index call; on failure resync or disconnect instead of raising."""
        try:
            fn()
            return True
        except StaleEpochError as e:
            logger.warning("prefix index: %s; registering %s again", e, self.group_id)
            self._resync()  # refused (fenced) when a newer process registered the group
        except IndexUnavailableError as e:
            self._disconnect(e)
        return False

    def _ensure_connected(self) -> bool:
        if self._fenced:
            return False
        return self._connected or (self._outage.may_retry() and self._resync())

    def _resync(self) -> bool:
        """Register a new epoch (naming the one held, if any) and republish the whole
        inventory; False if the index is out or a newer registration fenced this one off."""
        self._queue.clear()  # the inventory snapshot below already reflects these events
        try:
            # The snapshot first: taking it may wait for the engine's step (publish_thread.py),
            # which must not eat into the new registration's first TTL.
            hashes = by_medium(self.inventory())
            epoch = self.index.register_group(self.group_id, self._epoch)
        except StaleEpochError as e:
            self._fence(e)
            return False
        except (PrefixIndexError, TimeoutError) as e:
            self._disconnect(e)
            return False
        self._epoch = epoch  # held from now on, even if the republish below fails
        try:
            blocks = republish(self.index, self.group_id, epoch, hashes, self.config.republish_chunk)
        except PrefixIndexError as e:  # a stale epoch: a racing registration
            self._disconnect(e)
            return False
        self._outage.recovered(f"registered as epoch {epoch}, republished {blocks} blocks")
        self._connected = True
        self._last_beat = self._clock()
        return True

    def _fence(self, error: Exception) -> None:
        logger.error(
            "prefix index: %s; a newer process serves group %s: this one stops publishing",
            error,
            self.group_id,
        )
        self._fenced, self._connected = True, False
        self._queue.clear()
        if self._on_fenced is not None:
            self._on_fenced()

    def _disconnect(self, error: Exception) -> None:
        self._outage.failed(error, "serving continues and the inventory will be republished on reconnect")
        self._connected = False
        self._queue.clear()


def republish(
    index: IndexWriter,
    group_id: str,
    epoch: int,
    hashes: Inventory,
    chunk: int = 4096,
) -> int:
    """Publish a group's whole inventory (every medium's) under a new registration, `chunk`
    blocks per call; returns the number of blocks."""
    total = 0
    for medium, tier in by_medium(hashes).items():
        for i in range(0, len(tier), chunk):
            index.publish(group_id, epoch, [BlockStored(tier[i : i + chunk], None, medium)])
        total += len(tier)
    return total
