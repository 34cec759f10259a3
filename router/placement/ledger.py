"""A router's ledger of its recent placements, the one place it remembers them, with the views
a decision needs:

- the pending overlay (`PendingPlacements`): placements seen by this router's own next decisions
  at once and written to the shared prefix index in the background, so that requests sharing a
  prefix find the group that is computing it before that group reports its blocks;
- the prefill in flight: prompt tokens sent to each group that have not produced a first token,
  uncached and predicted cached, and their requests (a group's own load report lags by up to a
  step, and a burst must not all see it idle; it counts a waiting request's cached prefix as
  work);
- the placed share (`PlacedShare`): each group's part of the recent placements, for the
  policy's load bound;
- the streams moving: each stream this router is moving to another group (a drain, or for
  load), until its first token there (the groups' statuses may not show the move before; until
  then neither group takes part in another move for load, or one check's streams would all
  leave for the same idle group).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from itertools import repeat

from cluster.group import GroupStatus
from cluster.index import (
    GroupMatch,
    IndexReader,
    Matches,
    PendingWrite,
    PrefixIndexConfig,
    PrefixIndexError,
    touched_ids,
)
from cluster.index.outage import Outage
from cluster.index.probes import prefix_length, probe_hashes, probe_positions
from router.placement.policy import PlacedShare, Placement

log = logging.getLogger(__name__)


class Ledger:
    """This router's recent placements; see the module docstring."""

    def __init__(self, index: IndexReader, block_size: int, window: int = 200) -> None:
        self.index = index
        self.block_size = block_size
        self.pending = PendingPlacements(index)
        self.placed = PlacedShare(window)
        # group -> (prompt tokens sent uncached, predicted cached, requests) of requests without
        # a first token yet
        self.in_flight: dict[str, tuple[int, int, int]] = {}
        # request id -> (the group its stream leaves, the group it moves to), until its first
        # token there
        self.moving: dict[str, tuple[str, str]] = {}

    def matches(self, block_hashes: Sequence[bytes]) -> Matches:
        """The index's answer for the chain, with this router's own placements that the index
        may not show yet; when the index is out of reach, these alone."""
        matches, placed = {}, self.pending.unconfirmed()  # before the match is sent
        try:
            if block_hashes:
                matches = self.index.match(block_hashes)
        except PrefixIndexError as e:  # route on load and this router's placements alone
            log.warning("prefix index unavailable (%s); placing by load", e)
            placed = None  # nothing came back: every placement of ours counts
        return self.pending.overlay(block_hashes, matches, placed)

    def record(self, placement: Placement, block_hashes: Sequence[bytes], live_groups: int) -> None:
        """Count a decision: pending on its group, and in the group's placed share with the
        prompt tokens it sends there uncached."""
        self.pending.record(placement.group_id, block_hashes)
        new_tokens = (len(block_hashes) - placement.cached_blocks) * self.block_size
        self.placed.add(placement.group_id, new_tokens, live_groups)

    def add_in_flight(self, group_id: str, tokens: int, cached: int = 0, requests: int = 0) -> None:
        """Prompt tokens sent to the group uncached and predicted cached, of `requests`
        requests (negative: they produced their first token)."""
        sent, hits, n = self.in_flight.get(group_id, (0, 0, 0))
        sent, hits, n = sent + tokens, hits + cached, n + requests
        if sent > 0 or hits > 0 or n > 0:
            self.in_flight[group_id] = (sent, hits, n)
        else:
            self.in_flight.pop(group_id, None)

    def move(self, request_id: str, source: str, target: str) -> None:
        """Count a stream as moving from `source` to `target` until `arrived`."""
        self.moving[request_id] = (source, target)

    def arrived(self, request_id: str) -> None:
        """The stream's move is over: its first token came from the new group, or it stopped
        moving (any end of the attempt; a stream not moving is left as it is)."""
        self.moving.pop(request_id, None)

    def moving_groups(self) -> set[str]:
        """The groups that streams are moving from or to."""
        return {g for pair in self.moving.values() for g in pair}

    def with_in_flight(self, statuses: dict[str, GroupStatus]) -> dict[str, GroupStatus]:
        """`statuses` (a copy of this router's to change) with each group's queued prefill
        corrected by what this router has in flight there: at least the tokens it sent
        uncached (the group's report lags by up to a step), and without the tokens it predicted
        cached (a group counts a waiting request's whole prompt as work until it admits it and
        finds its prefix: a hot document's questions queued on its holder would count the
        document once each)."""
        for gid, (sent, hits, _) in self.in_flight.items():  # only groups with prefill in flight
            s = statuses.get(gid)
            if s is not None:
                queued = max(sent, s.pending_prefill_tokens - hits)
                if queued != s.pending_prefill_tokens:
                    statuses[gid] = replace(s, pending_prefill_tokens=queued)
        return statuses

    def with_requests_in_flight(self, statuses: dict[str, GroupStatus]) -> dict[str, GroupStatus]:
        """`statuses` (a copy to change) with each group's waiting requests at least this
        router's requests in flight there: until its first token a request waits, or is not
        in the group's report yet (it lags by up to a step). For the load checks of streams
        (router/router.py, `load_move_target`): a group that was just sent requests is not idle."""
        for gid, (*_, n) in self.in_flight.items():
            s = statuses.get(gid)
            if s is not None and n > s.waiting:
                statuses[gid] = replace(s, waiting=n)
        return statuses


class PendingPlacements:
    """This router's recent placements, seen by its own next decisions at once and written to
    the shared index in the background, off the request's path.

    `record` only hands the placement to one writer thread (an inbox, seen by `unconfirmed` at
    once); the writer does the bookkeeping below and drains a bounded, coalescing queue (one
    entry per distinct (group, chain)) with one `index.record_pending_many` call per drain, so
    other routers see a placement a moment (one write's round trip) after it was made. Until
    its write returns, a placement is "unconfirmed": `overlay` adds the unconfirmed ones (taken
    before the match was sent) to the index's answer; a confirmed one is in that answer
    already. A failed or dropped write stays unconfirmed until its deadline. Write errors are
    logged once per run of failures and never reach the caller.

    Rewrites are skipped: a placement whose leading probes this router recorded on the group
    with more than half a TTL left writes only the rest (a hot document's questions write their
    own tails, not the document again), and one with nothing new writes nothing. Such a
    placement is pending for at least half a TTL. An in-process index is its own local table:
    it is written at once and nothing else is kept.
    """

    def __init__(
        self,
        index: IndexReader,
        ttl_s: float | None = None,
        max_queued: int = 1024,
        idle_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        config = getattr(index, "config", None) or PrefixIndexConfig()
        self.index = index
        self.ttl_s = config.pending_ttl_s if ttl_s is None else ttl_s
        self.max_queued = max_queued
        self.idle_s = idle_s  # the writer thread exits after this long without work
        self._clock = clock
        self._lock = threading.Condition()
        # What this router wrote, group -> probe hash -> deadline, in two generations: an entry
        # goes into `_current`, which becomes `_previous` after a TTL and is dropped after
        # another (no sweeps). Deadlines never grow along a chain, as in the index.
        self._current: dict[str, dict[bytes, float]] = {}
        self._previous: dict[str, dict[bytes, float]] = {}
        self._rotate_at = clock() + self.ttl_s
        self._queue: dict[tuple[str, bytes], PendingWrite] = {}  # insertion-ordered
        self._placed: dict[tuple[str, bytes], _Placed] = {}  # unexpired placements, oldest first
        self._unconfirmed: set[tuple[str, bytes]] = set()  # keys of `_placed` not yet written
        # Placements handed over by `record`, not yet in `_placed`: (group, chain, probes, when)
        self._inbox: list[tuple[str, Sequence[bytes], tuple[bytes, ...], float]] = []
        self._writing = False
        self._writer: threading.Thread | None = None
        self._outage = Outage(log, "shared index (pending placements)", clock=clock)

    def record(self, group_id: str, block_hashes: Sequence[bytes]) -> None:
        """Count the chain as pending on the group here now, and in the shared index soon."""
        if not block_hashes:
            return
        if self.index.in_process:
            with contextlib.suppress(PrefixIndexError):
                self.index.record_pending(group_id, block_hashes)
            return
        now = self._clock()
        # Only the probe positions (96 of a 2048-block chain), as the Redis index keeps.
        probed = probe_hashes(block_hashes)
        with self._lock:
            self._inbox.append((group_id, block_hashes, probed, now))
            if self._writer is None:
                self._writer = threading.Thread(target=self._drain, name="pending-writer", daemon=True)
                self._writer.start()
            self._lock.notify()

    def _admit(self, group_id: str, block_hashes: Sequence[bytes], probed: tuple[bytes, ...], now: float) -> None:
        """Book one placement from the inbox and queue its write (the writer, lock held)."""
        if now >= self._rotate_at:
            self._previous, self._current = self._current, {}
            self._rotate_at = now + self.ttl_s
        cur, prev = self._current.get(group_id, {}), self._previous.get(group_id, {})

        def deadline(h: bytes) -> float:
            return max(cur.get(h, 0.0), prev.get(h, 0.0))

        after = now + self.ttl_s / 2  # deadlines never grow along a chain: a prefix qualifies
        fresh = prefix_length(len(probed), lambda i: deadline(probed[i]) > after)
        if fresh == len(probed):
            return  # pending in the index for at least half a TTL more
        until = deadline(probed[fresh - 1]) if fresh else now + self.ttl_s
        self._current.setdefault(group_id, {}).update(zip(probed[fresh:], repeat(until)))
        key = (group_id, probed[-1])  # chained hashes: the last one names the chain
        self._placed.pop(key, None)  # re-inserted at the end: the order stays by age
        self._placed[key] = _Placed(group_id, probed, until)
        self._unconfirmed.add(key)
        self._trim_placed(now)
        if key in self._queue or len(self._queue) < self.max_queued:
            self._queue[key] = PendingWrite(group_id, block_hashes, fresh)
        else:
            self._outage.failed(RuntimeError("the queue is full"), "dropping a shared write")

    def unconfirmed(self) -> list[_Placed]:
        """Placements whose shared write has not returned: what a match sent now may miss."""
        if not self._unconfirmed and not self._inbox:  # the writer caught up; no lock needed
            return []
        with self._lock:
            return [self._placed[k] for k in self._unconfirmed if k in self._placed] + self._handed()

    def _handed(self) -> list[_Placed]:
        """The inbox's placements, as the writer will book them at the latest (lock held)."""
        return [_Placed(g, probed, t + self.ttl_s) for g, _, probed, t in self._inbox]

    def overlay(
        self,
        block_hashes: Sequence[bytes],
        matches: Mapping[str, GroupMatch],
        placed: Sequence[_Placed] | None = None,
    ) -> Matches:
        """`matches` with each group's pending blocks raised to this router's placements:
        `placed` (`unconfirmed()` taken before the match was sent: the match holds the rest),
        by default all of them. O(len(placed)), not O(groups)."""
        out = Matches(matches, touched_ids(matches))
        if placed is None:
            with self._lock:
                placed = list(self._placed.values()) + self._handed()
        if not placed or not block_hashes:
            return out
        now, h0, pos = self._clock(), block_hashes[0], None
        for p in placed:
            if p.deadline <= now or p.probes[0] != h0:
                continue  # the usual case: another document
            m = out.get(p.group_id) or GroupMatch(p.group_id, 0, 0, 0)  # index down
            if pos is None:
                pos, probed = probe_positions(len(block_hashes)), probe_hashes(block_hashes)
            k = _shared_probes(probed, p.probes)
            if pos[k - 1] + 1 > m.pending_blocks:
                if not m.expected_blocks:
                    out.touched.append(p.group_id)
                out[p.group_id] = m._replace(pending_blocks=pos[k - 1] + 1)
        return out

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every queued write reached the index (or failed); False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._queue or self._writing or self._inbox:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(min(left, 0.05))
        return True

    def _drain(self) -> None:
        while True:
            with self._lock:
                self._writing = False
                self._lock.notify_all()
                if not self._queue and not self._inbox:
                    self._lock.wait(self.idle_s)
                    if not self._queue and not self._inbox:
                        self._writer = None
                        return
                inbox, self._inbox = self._inbox, []
                for entry in inbox:
                    self._admit(*entry)
                if not self._queue:
                    continue  # nothing new to write
                batch, self._queue = self._queue, {}
                placed = {key: self._placed.get(key) for key in batch}
                self._writing = True
            if self._write(list(batch.values())):
                with self._lock:
                    for key, p in placed.items():
                        if self._placed.get(key) is p:  # not placed again meanwhile
                            self._unconfirmed.discard(key)

    def _write(self, writes: list[PendingWrite]) -> bool:
        try:
            self.index.record_pending_many(writes, self.ttl_s)
            self._outage.recovered()
            return True
        except Exception as e:  # noqa: BLE001  (a background write must never kill the writer)
            self._outage.failed(e, "pending placements not shared until a write succeeds")
            with self._lock:  # the index may lack what we wrote: the next placements write all
                self._current, self._previous = {}, {}
            return False

    def _trim_placed(self, now: float) -> None:
        """Drop expired placements (oldest first) and bound the table; the lock is held."""
        table = self._placed
        while table:
            key = next(iter(table))
            if table[key].deadline > now and len(table) <= 4 * self.max_queued:
                break
            del table[key]
            self._unconfirmed.discard(key)


@dataclass(frozen=True)
class _Placed:
    """A placement this router made: its chain's probe hashes, pending until `deadline`."""

    group_id: str
    probes: tuple[bytes, ...]  # at `probe_positions` of the chain's length
    deadline: float  # the router's clock


def _shared_probes(a: Sequence[bytes], b: Sequence[bytes]) -> int:
    """How many leading probes two chains share. Probed at the same positions (but for their
    last probes) and chained, they agree exactly up to some probe."""
    return prefix_length(min(len(a), len(b)), lambda i: a[i] == b[i])
