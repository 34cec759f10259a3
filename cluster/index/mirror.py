"""A router's local copy of the Redis prefix index, so that a decision makes no round trip.

`MirroredPrefixIndex` is a router's reader (cluster/index/base.py) of the `RedisPrefixIndex`
that groups write to: `match` is answered from a copy in this process, kept current by a
follower thread that loads a snapshot of the index and then follows its log (the `log` stream
every write script appends to; see cluster/index/redis_scripts.py). Every router over one Redis
reads the same log, so their copies hold the same state a moment (one log delivery) after each
write, the way every router of one cluster sees the same Redis.

The copy (cluster/index/copy.py, kept inverted so that a match costs about the same at any
group count) answers what `RedisPrefixIndex.match` answers: the leading cached blocks of the
chain on each live group (at the chain's probe positions, then between the last probe held and
the first missed) and the leading pending blocks at probe granularity, and below the device
the blocks that continue on each group's host and disk tiers. Liveness is kept on this process's clock: a group is live until `heartbeat_ttl_s` after
the last log entry of its registration arrived (after a snapshot, for as long as its registration
had left in Redis: a group that died just before it leaves the copy when it leaves Redis).

When the follower cannot read the log (Redis down, or the copy fell behind the log's trimmed
start), `match` asks Redis directly, which raises `IndexUnavailableError` when Redis is down, as
the plain index does; the follower reloads a snapshot as soon as Redis answers again. A log entry
whose sequence number is not the next one (the log was trimmed past the copy, or Redis restarted
and lost it) also sends the follower back to the snapshot, so the copy never drifts silently.

A placement this router records is applied to the copy as soon as Redis took it (before its log
entry comes back), so a router's next decision always sees its own placements.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence

from cluster.index.base import IndexReader
from cluster.index.copy import IndexCopy
from cluster.index.outage import Outage
from cluster.index.probes import probe_hashes
from cluster.index.redis_index import RedisPrefixIndex, to_ms
from cluster.index.types import IndexHealth, InventoryStats, Matches, PendingWrite, TierInventory
from worker.hashing import HashChain
from worker.kv_events import DEVICE, DISK, HOST, MEDIUMS

log = logging.getLogger(__name__)

# Log kinds of blocks stored / removed, by medium (redis_scripts.py: "The log").
_STORES = {b"S": DEVICE, b"SH": HOST, b"SD": DISK}
_REMOVALS = {b"R": DEVICE, b"RH": HOST, b"RD": DISK}


class MirroredPrefixIndex(IndexReader):
    """A `RedisPrefixIndex` whose `match` is answered locally; see the module docstring."""

    def __init__(
        self,
        shared: RedisPrefixIndex,
        read_block_s: float = 0.1,
        retry_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`read_block_s`: how long one log read waits for new entries (also how soon `close`
        stops the follower); `retry_s`: the wait between attempts while Redis is out of reach."""
        if not 0 < read_block_s < shared.config.heartbeat_ttl_s:
            raise ValueError(f"read_block_s must be in (0, heartbeat_ttl_s), got {read_block_s}")
        if not retry_s > 0:
            raise ValueError(f"retry_s must be > 0, got {retry_s}")
        self.shared = shared
        self.config = shared.config
        self.read_block_s = read_block_s
        self.retry_s = retry_s
        self._clock = clock
        self._ttl = shared.config.heartbeat_ttl_s
        self._log = shared.prefix + "log"
        self._lock = threading.Lock()
        self._copy = IndexCopy(self._ttl)
        self._seq: int | None = None  # last applied log entry; None: not in sync
        self._read_ok_at = float("-inf")  # when the last log read returned
        self._outage = Outage(log, "prefix index log (mirror)", retry_s, retry_s, clock)
        self._conn = None  # the follower's own connection (its reads block)
        self.snapshots = 0  # snapshots loaded: one at start, one per gap or outage
        self._stop = threading.Event()
        self._follower = threading.Thread(target=self._follow, name="index-mirror", daemon=True)
        self._follower.start()

    # ---- state of the copy ------------------------------------------------------------
    @property
    def synced(self) -> bool:
        """Whether `match` is answered locally now (in sync and the log read is current)."""
        return self._seq is not None and self._clock() - self._read_ok_at < self._max_lag()

    def wait_synced(self, timeout_s: float = 5.0) -> bool:
        """Block until the copy is in sync with everything written so far; False on timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                seq = int(self.shared.client.get(self.shared.prefix + "logseq") or 0)
            except Exception:  # noqa: BLE001  (Redis down: not in sync)
                seq = None
            if seq is not None and self._seq is not None and self._seq >= seq and self.synced:
                return True
            time.sleep(0.005)
        return False

    def health(self) -> IndexHealth:
        """Redis reachable as the follower last found it (or in sync: its outage is marked
        over just after the read that ends it); lag since its last log read."""
        reachable = self._outage.up or self.synced
        with self._lock:
            now = self._clock()
            entries, blocks, groups = self._copy.live_inventory(now)
            lag = now - self._read_ok_at if self._seq is not None else math.inf
        return IndexHealth(True, reachable, lag, entries, blocks, groups)

    # ---- reads: the copy ----------------------------------------------------------------
    def match(self, block_hashes: Sequence[bytes]) -> Matches:
        if not self.synced:
            return self.shared.match(block_hashes)  # IndexUnavailableError when Redis is down
        with self._lock:
            return self._copy.match(block_hashes, self._clock())

    def inventory(self, group_id: str) -> TierInventory | None:
        """The copy's hashes per medium of the group's live registration; None when not live."""
        with self._lock:
            g = self._copy.groups.get(group_id)
            return None if g is None or g.deadline <= self._clock() else g.tiers()

    # ---- a router's writes: Redis, then the copy ------------------------------------------
    def inventory_stats(self) -> InventoryStats:
        return self.shared.inventory_stats()

    def record_pending_many(self, writes: Sequence[PendingWrite], ttl_s: float | None = None) -> None:
        self.shared.record_pending_many(writes, ttl_s)
        ttl = self.config.pending_ttl_s if ttl_s is None else ttl_s
        with self._lock:  # the same rule as the pending script, on this clock
            now = self._clock()
            for w in writes:
                g = self._copy.groups.get(w.group_id)
                if g is not None and w.block_hashes:
                    probed = probe_hashes(w.block_hashes)
                    self._copy.place(g, probed, min(w.fresh_probes, len(probed)), ttl, now)

    def close(self) -> None:
        self._stop.set()
        self._follower.join(timeout=2 * self.read_block_s + 1.0)
        if self._conn is not None:
            self._conn.disconnect()
        self.shared.close()

    # ---- the follower thread ----------------------------------------------------------------
    def _max_lag(self) -> float:
        """A log read returns at least every read_block_s; a copy not read for several of those
        (a stalled follower, a slow Redis) is no longer trusted."""
        return min(self._ttl / 2, 10 * self.read_block_s + 0.5)

    def _follow(self) -> None:
        last_id = "0-0"
        while not self._stop.is_set():
            try:
                if self._seq is None:
                    last_id = self._load_snapshot()
                last_id = self._read_log(last_id)
                self._read_ok_at = self._clock()
                self._outage.recovered("the mirror is in sync again")
            except Exception as e:  # noqa: BLE001  (the follower must outlive any fault)
                self._seq = None
                self._outage.failed(e, "the mirror is out of sync; matching on Redis")
                self._stop.wait(self.retry_s)

    def _load_snapshot(self) -> str:
        """Replace the copy with the snapshot script's answer; returns the log position to read
        from (the stream's last id at the snapshot: entries after it have larger seqs)."""
        seq, last_id, *rows, pend = self.shared.snapshot()
        now, copy = self._clock(), IndexCopy(self._ttl)
        for i in range(0, len(rows), 6):
            gid, epoch, ttl_ms, *inventories = rows[i : i + 6]  # device, host, disk
            # Live as long as Redis keeps it, not a TTL from now: a group that died just before
            # the snapshot leaves the copy when it leaves Redis.
            ttl = int(ttl_ms) / 1000 if int(ttl_ms) > 0 else None
            g = copy.register(gid.decode(), int(epoch), now, ttl)
            for medium, inventory in zip(MEDIUMS, inventories, strict=True):
                copy.store(g, HashChain(inventory), medium)
        for line in pend:
            gid, epoch, ttl_ms, h = line.split(b"\t", 3)
            g = copy.groups.get(gid.decode())
            if g is not None and g.epoch == int(epoch):
                copy.add_pending(g, (h,), now + int(ttl_ms) / 1000, now)
        with self._lock:
            self._copy, self._seq = copy, int(seq)
        self.snapshots += 1
        return last_id.decode()

    def _read_log(self, last_id: str) -> str:
        """Apply the entries after `last_id` (waiting up to read_block_s for some)."""
        if self._conn is None:
            self._conn = self.shared.new_connection()
        conn, block = self._conn, to_ms(self.read_block_s)
        try:
            conn.send_command("XREAD", "COUNT", 4096, "BLOCK", block, "STREAMS", self._log, last_id)
            reply = conn.read_response()
        except Exception:
            conn.disconnect()  # a half-read reply must not be taken for the next one's
            raise
        if not reply:
            return last_id
        # RESP3 answers a map {stream: entries}, RESP2 a list [[stream, entries]].
        entries = next(iter(reply.values())) if isinstance(reply, dict) else reply[0][1]
        with self._lock:
            now = self._clock()
            for entry_id, fields in entries:  # fields: [b"v", value]
                if not self._apply(fields[1], now):
                    self._seq = None  # a gap: back to the snapshot
                    return last_id
                last_id = entry_id
        return last_id.decode() if isinstance(last_id, bytes) else last_id

    def _apply(self, value: bytes, now: float) -> bool:
        """Apply one log entry; False when its seq is not the next (the lock is held)."""
        kind, seq, gid, epoch, payload = value.split(b"\t", 4)
        if self._seq is None or int(seq) != self._seq + 1:
            return False
        self._seq += 1
        name, epoch, copy = gid.decode(), int(epoch), self._copy
        if kind == b"G":
            copy.register(name, epoch, now)
            return True
        g = copy.groups.get(name)
        if g is None or g.epoch != epoch:
            return True  # a registration this copy already dropped
        if kind == b"D":
            copy.drop(name)
            return True
        if kind != b"Q":  # a group's own write; a router's placement says nothing of its liveness
            copy.touch(g, now)
        if kind in _STORES:
            copy.store(g, HashChain(payload), _STORES[kind])
        elif kind in _REMOVALS:
            copy.remove(g, HashChain(payload), _REMOVALS[kind])
        elif kind == b"C":
            copy.clear(g)
        elif kind == b"Q":
            ttl_ms, blob = payload.split(b"\t", 1)
            copy.add_pending(g, HashChain(blob), now + int(ttl_ms) / 1000, now)
        return True
