"""The prefix index in Redis, shared by every router and group of one cluster and model.

The data layout and the Lua scripts are in cluster/index/redis_scripts.py; this module is the client
side: every method is one EVALSHA (one round trip), arguments packed so that redis-py does
little work (a chain is one argument, its 16-byte hashes concatenated), and the match reply
parsed with the groups' rows kept between calls.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
import uuid
from collections.abc import Iterator, Sequence

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from cluster.index.base import PrefixIndex
from cluster.index.probes import probe_hashes
from cluster.index.redis_scripts import PRELUDE, SCRIPTS
from cluster.index.types import (
    GroupMatch,
    IndexUnavailableError,
    InventoryStats,
    Matches,
    PendingWrite,
    PrefixIndexConfig,
    StaleEpochError,
    TierInventory,
    check_medium,
    check_name,
)
from worker.hashing import DIGEST_SIZE, HashChain
from worker.kv_events import DEVICE, DISK, HOST, MEDIUMS, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

# Parsed hb rows a client keeps: a few registrations of each of hundreds of groups.
_MAX_ROWS = 4096

# Errors that mean "the index is out of reach for now", as opposed to our own bugs.
_UNAVAILABLE = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.ReadOnlyError,
    redis.exceptions.OutOfMemoryError,
    redis.exceptions.MasterDownError,
    redis.exceptions.TryAgainError,
)


@contextlib.contextmanager
def _unavailable_as_index_error() -> Iterator[None]:
    try:
        yield
    except _UNAVAILABLE as e:
        raise IndexUnavailableError(f"{type(e).__name__}: {e}") from e


class RedisPrefixIndex(PrefixIndex):
    """The prefix index over one Redis; every method is one round trip (scripts by EVALSHA).

    Thread-safe: each call takes a connection no other call is using.
    """

    def __init__(
        self,
        client: redis.Redis,
        cluster: str,
        model: str,
        config: PrefixIndexConfig | None = None,
    ) -> None:
        self.config = config or PrefixIndexConfig()
        self.client = client
        self.prefix = f"pf:{check_name('cluster', cluster)}:{check_name('model', model)}:"
        self._ttl_ms = to_ms(self.config.heartbeat_ttl_s)
        self._rows: dict[bytes, GroupMatch] = {}  # hb row -> the group's match of nothing
        self._bodies = {name: PRELUDE + body for name, body in SCRIPTS.items()}
        self._shas = {name: hashlib.sha1(b.encode()).hexdigest() for name, b in self._bodies.items()}
        # Scripts run on connections of our own, straight through their parser: the client's
        # command path (pool, retries, instrumentation) costs more CPU than the call. A
        # call takes an idle one (or makes one) and gives it back: as many as calls at once.
        self._idle: list[redis.Connection] = []
        self._idle_lock = threading.Lock()
        self._closed = False

    @classmethod
    def from_url(
        cls,
        url: str,
        cluster: str,
        model: str,
        config: PrefixIndexConfig | None = None,
        socket_timeout_s: float = 1.0,
    ) -> RedisPrefixIndex:
        """An index on a new client for `url` that fails fast: the caller decides on retries."""
        client = redis.Redis.from_url(
            url,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=socket_timeout_s,
            # One quick retry rides over a dropped idle connection; redis-py's default
            # (10 retries, backoff up to 10 s) would stall an engine step for a minute.
            retry=Retry(ExponentialBackoff(cap=0.05, base=0.01), 1),
            client_name=f"pagefleet-index-{uuid.uuid4().hex[:8]}",
        )
        return cls(client, cluster, model, config)

    def ping(self) -> None:
        """IndexUnavailableError unless Redis answers."""
        with _unavailable_as_index_error():
            self.client.ping()

    def register_group(self, group_id: str, previous: int | None = None) -> int:
        check_name("group_id", group_id)
        epoch = int(self._run("register", group_id, self._ttl_ms, previous or 0))
        if epoch == 0:
            raise StaleEpochError(f"register: group {group_id!r} epoch {previous} was fenced off")
        return epoch

    def publish(self, group_id: str, epoch: int, events: Sequence[KVEvent]) -> None:
        result = self._run("publish", group_id, epoch, self._ttl_ms, *_encode_events(events))
        self._fenced("publish", group_id, epoch, result)

    def heartbeat(self, group_id: str, epoch: int) -> None:
        self._fenced("heartbeat", group_id, epoch, self._run("beat", group_id, epoch, self._ttl_ms))

    def deregister(self, group_id: str, epoch: int) -> None:
        self._run("deregister", group_id, epoch)

    def match(self, block_hashes: Sequence[bytes]) -> Matches:
        reply = self._run("match", _blob(block_hashes))
        out = Matches()
        if not reply:
            return out
        counts, _, rows = reply.partition(b"\n\n")
        known = self._rows
        for row in rows.split(b"\n"):
            m = known.get(row) or self._parse_row(row)
            out[m.group_id] = m
        for line in counts.split(b"\n") if counts else ():
            gid, *numbers = line.split(b"\t")  # cached, pending [, host, disk]
            m = out[gid.decode()]
            out[m.group_id] = GroupMatch(m.group_id, m.epoch, *map(int, numbers))
            out.touched.append(m.group_id)
        return out

    def inventory(self, group_id: str) -> TierInventory | None:
        """The group's live registration's hashes per medium; None when not live. Reads whole
        sets: for tests and tools, not for the hot path."""
        c, p = self.client, self.prefix
        with _unavailable_as_index_error():
            epoch, row = c.hget(p + "groups", group_id), c.get(f"{p}hb:{group_id}")
            if epoch is None or row is None or not row.startswith(group_id.encode() + b"\t" + epoch + b"\t"):
                return None
            return {m: frozenset(c.smembers(f"{p}{_TIER_KEYS[m]}{group_id}")) for m in MEDIUMS}

    def _parse_row(self, row: bytes) -> GroupMatch:
        """A live group's hb row as a match of nothing; kept while the registration lives."""
        gid, epoch, _ = row.split(b"\t", 2)
        m = GroupMatch(gid.decode(), int(epoch), 0, 0)
        if len(self._rows) >= _MAX_ROWS:  # old registrations of every group: start over
            self._rows.clear()
        self._rows[row] = m
        return m

    def record_pending_many(self, writes: Sequence[PendingWrite], ttl_s: float | None = None) -> None:
        """One script call for every placement; see PENDING in cluster/index/redis_scripts.py."""
        ttl = self.config.pending_ttl_s if ttl_s is None else ttl_s
        if not ttl > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        args: list[object] = []
        for w in writes:
            check_name("group_id", w.group_id)
            if w.block_hashes:
                # Only the probe positions: match never looks at the others (a 2048-block chain
                # writes 96 entries instead of 2048).
                probed = probe_hashes(w.block_hashes)
                args += [w.group_id, min(w.fresh_probes, len(probed)), _blob(probed)]
        if args:
            self._run("pending", to_ms(ttl), *args)

    def cleanup(self) -> int:
        return int(self._run("cleanup"))

    def snapshot(self) -> list:
        """The whole index at one log position, for a mirror (SNAPSHOT in redis_scripts.py)."""
        return self._run("snapshot")

    def inventory_stats(self) -> InventoryStats:
        """Counts by SCARD/SUNION and bytes by MEMORY USAGE of the groups' `inv` sets.

        `bytes_per_block` is the memory of one (group, block) entry: the sets' MEMORY USAGE
        (estimated from `stats_sample_keys` sampled members each) over the number of entries.
        It does not include pending placements nor the change log (`log_bytes`, apart). SUNION
        copies every hash: not for the hot path.
        """
        c, p = self.client, self.prefix
        with _unavailable_as_index_error():
            groups = c.hgetall(p + "groups")
            heads = {g.decode(): g + b"\t" + e + b"\t" for g, e in groups.items()}
            rows = c.mget([f"{p}hb:{g}" for g in heads]) if heads else []
            live = [g for (g, h), r in zip(heads.items(), rows, strict=True) if r and r.startswith(h)]
            inv_keys = [f"{p}inv:{g}" for g in live]
            entries = sum(c.scard(k) for k in inv_keys)
            lower = sum(c.scard(f"{p}{_TIER_KEYS[m]}{g}") for g in live for m in (HOST, DISK))
            blocks = len(c.sunion(inv_keys)) if inv_keys else 0
            samples = self.config.stats_sample_keys
            total = sum(c.memory_usage(k, samples=samples) or 0 for k in inv_keys)
            log_bytes = c.memory_usage(p + "log", samples=samples) or 0
        if not entries:
            return InventoryStats(0, 0, len(live), log_bytes=log_bytes, lower_entries=lower)
        return InventoryStats(entries, blocks, len(live), total / entries, total, log_bytes, lower)

    def close(self) -> None:
        with self._idle_lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.disconnect()
        self.client.close()

    def new_connection(self) -> redis.Connection:
        """A connection of its own to the index's Redis, with the client's settings (the
        caller disconnects it)."""
        return self.client.connection_pool.make_connection()

    def _run(self, script: str, *args: object) -> object:
        """EVALSHA of a script on an idle connection: the body is loaded on NOSCRIPT (a new or
        restarted Redis), and a dropped connection is retried once."""
        with self._idle_lock:
            conn = self._idle.pop() if self._idle else None
        conn = conn or self.new_connection()
        try:
            with _unavailable_as_index_error():
                return self._evalsha(conn, script, args)
        finally:
            with self._idle_lock:
                closed = self._closed
                if not closed:
                    self._idle.append(conn)
            if closed:
                conn.disconnect()

    def _evalsha(self, conn: redis.Connection, script: str, args: tuple) -> object:
        for attempt in range(3):
            try:
                conn.send_command("EVALSHA", self._shas[script], 0, self.prefix, *args)
                return conn.read_response()
            except redis.exceptions.NoScriptError:
                conn.send_command("SCRIPT", "LOAD", self._bodies[script])
                conn.read_response()
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
                conn.disconnect()  # the next send reconnects; a half-read reply is dropped
                if attempt:
                    raise
        raise IndexUnavailableError(f"script {script} could not be loaded")

    @staticmethod
    def _fenced(what: str, group_id: str, epoch: int, result: object) -> None:
        if result != 1:
            raise StaleEpochError(f"{what}: group {group_id!r} epoch {epoch} is not live")


# The set of each medium: P inv:<group>, host:<group>, disk:<group> (redis_scripts.py).
_TIER_KEYS = {DEVICE: "inv:", HOST: "host:", DISK: "disk:"}
# A publish op's suffix by medium: S / R on the device, SH / RH on the host, SD / RD on disk.
_OP_SUFFIX = {DEVICE: "", HOST: "H", DISK: "D"}


def _encode_events(events: Sequence[KVEvent]) -> list[str]:
    """The publish script's ARGV tail: op blob | 'C', in event order (see PUBLISH)."""
    out: list[str | bytes] = []
    for event in events:
        if isinstance(event, BlockStored | BlockRemoved):
            op = ("S" if isinstance(event, BlockStored) else "R") + _OP_SUFFIX[check_medium(event.medium)]
            out += [op, _blob(event.block_hashes)]
        elif isinstance(event, AllBlocksCleared):
            out.append("C")
        else:
            raise TypeError(f"unknown KV event {event!r}")
    return out


def _blob(hashes: Sequence[bytes]) -> bytes:
    """Hashes concatenated into one script argument; each must be DIGEST_SIZE bytes."""
    if isinstance(hashes, HashChain):
        return hashes.blob  # already one
    blob = b"".join(hashes)
    if len(blob) != DIGEST_SIZE * len(hashes):
        raise ValueError(f"block_hashes must all be {DIGEST_SIZE}-byte hashes")
    return blob


def to_ms(seconds: float) -> int:
    """A duration as whole milliseconds (at least 1), as Redis takes TTLs and timeouts."""
    return max(1, round(seconds * 1000))
