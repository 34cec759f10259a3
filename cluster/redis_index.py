"""The prefix index in Redis, shared by every router and group of one cluster and model.

Data layout; every key starts with P = `pf:<cluster>:<model>:`; block hashes are stored as their
raw 16 bytes (set members and script arguments are binary-safe, so no key contains a hash):

    P epochs          hash  group -> last epoch handed out (HINCRBY; never shrinks)
    P groups          hash  group -> epoch of its current registration
    P hb:<group>      string  the group's row of the match reply, `group TAB epoch TAB load`
                      (load: GroupLoad as JSON, empty until reported), PX heartbeat_ttl
    P inv:<group>     set   every block hash the current registration caches, PX heartbeat_ttl
    P pend:<group>    zset  block hash -> deadline (Redis TIME, ms), PX the longest pending TTL
    P pending         hash  group -> latest deadline in pend:<group>, PX the longest pending TTL

A group is live while `hb:<group>` exists and starts with `group TAB groups[group] TAB`. Each
heartbeat, load report or publish refreshes the TTLs of hb and inv together, so when a group
dies all its keys expire by themselves; `cleanup()` only forgets its `groups` field. The load
lives in the hb row so that one MGET answers liveness, epoch and load for every group, and the
client keeps the rows it parsed (a row changes only with the group's load report).

`match` is one EVALSHA whose argument is the chain's hashes concatenated. The script reads
`groups` (HKEYS), every hb row (one MGET) and `pending` (one HMGET), then asks each live group
one SISMEMBER of the chain's first block: a group that does not hold it holds none of the chain
(~1.5 us a group in the script). A group that holds it gets one SMISMEMBER of all the chain's
probe positions (every block up to 32, then every 32nd, then the last) and one of the blocks
between the last probe hit and the first miss. A group with unexpired pending entries of the
first block gets a binary search for its last pending probe (ZSCORE, about 7 for 96 probes);
pending sets store only the probe positions of each placed chain. The reply names only the
groups that hold or have pending some of the chain, then lists every live group's row.
Measured at 64 groups and 32k-token prompts: the per-group probe loop of growing SMISMEMBER
chunks cost ~5 us a group, and ZMSCORE of all probes on each of the ~30 groups a hot document
is pending on cost ~2 ms a match. The layout is per group rather than per block because a
per-block hash of holders costs one HGETALL per block in Lua, and because AllBlocksCleared,
re-registration and death then each delete one key.

Every write script first checks that (group, epoch) is live, so a group restarted under a new
epoch fences off its old process. Scripts compute key names from P, so all keys of one index must
live on one Redis (a single server or a replicated primary, not Redis Cluster).
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator, Sequence

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from cluster.prefix_index import (
    PROBE_DENSE,
    PROBE_STRIDE,
    GroupLoad,
    GroupMatch,
    IndexUnavailableError,
    InventoryStats,
    PrefixIndex,
    PrefixIndexConfig,
    StaleEpochError,
    check_name,
    probe_positions,
)
from worker.hashing import DIGEST_SIZE
from worker.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

# Shared by every script: ARGV[1] is the key prefix P. A chain travels as one argument, its
# 16-byte hashes concatenated (packing thousands of arguments costs redis-py more than the whole
# match costs Redis). `unpack` is bounded by Lua's C stack (about 8000 values), hence CHUNK.
_PRELUDE = (
    """
local P = ARGV[1]
local CHUNK = 1024
local W = DIGEST_SIZE
-- Hashes first..last (1-based) of a blob of concatenated hashes.
local function slice(blob, first, last)
  local t = {}
  for i = first, last do t[#t + 1] = string.sub(blob, (i - 1) * W + 1, i * W) end
  return t
end
-- The start of a registration's row in hb:<g>, `group TAB epoch TAB`; the load report follows.
local function row_head(g, e) return g .. '\\t' .. e .. '\\t' end
local function live_epoch(g)
  local e = redis.call('HGET', P .. 'groups', g)
  if not e then return nil end
  local row, head = redis.call('GET', P .. 'hb:' .. g), row_head(g, e)
  if row and string.sub(row, 1, #head) == head then return e end
  return nil
end
local function drop_registration(g)
  redis.call('HDEL', P .. 'groups', g)
  redis.call('DEL', P .. 'hb:' .. g, P .. 'inv:' .. g, P .. 'pend:' .. g)
  redis.call('HDEL', P .. 'pending', g)
end
local function refresh(g, ttl)
  redis.call('PEXPIRE', P .. 'hb:' .. g, ttl)
  redis.call('PEXPIRE', P .. 'inv:' .. g, ttl)
end
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
-- Apply `cmd key hash...` to every hash of `blob`, in chunks.
local function each_chunk(cmd, key, blob)
  local total = #blob / W
  for i = 1, total, CHUNK do
    redis.call(cmd, key, unpack(slice(blob, i, math.min(i + CHUNK - 1, total))))
  end
end
-- How many leading hashes of the list `hs` pass `ok` on the replies of `cmd key hash...`, asked
-- in chunks of `size` hashes, then twice as many, ...
local function leading(cmd, key, hs, ok, size)
  local n, i = 0, 1
  while i <= #hs do
    local last = math.min(i + size - 1, #hs)
    local replies = redis.call(cmd, key, unpack(hs, i, last))
    for _, r in ipairs(replies) do
      if not ok(r) then return n end
      n = n + 1
    end
    i, size = last + 1, math.min(2 * size, CHUNK)
  end
  return n
end
-- Probe positions (1-based) of an n-block chain: every block up to DENSE, then every
-- STRIDE-th, then the last. Python's `probe_positions` is the same list, 0-based.
local DENSE, STRIDE = PROBE_DENSE, PROBE_STRIDE
local function probes(n)
  local pos = {}
  for p = 1, math.min(n, DENSE) do pos[#pos + 1] = p end
  for p = DENSE + STRIDE, n, STRIDE do pos[#pos + 1] = p end
  if n > 0 and pos[#pos] ~= n then pos[#pos + 1] = n end
  return pos
end
local function hashes_at(blob, positions)
  local t = {}
  for _, p in ipairs(positions) do t[#t + 1] = string.sub(blob, (p - 1) * W + 1, p * W) end
  return t
end
-- Leading blocks of the chain held in `key`, known to hold the first block: all probes in one
-- call (one call per chunk costs more than the lookups), then the blocks between the last probe
-- hit and the first probe miss. Exact within the first DENSE blocks; beyond, exact when the
-- holdings are prefix-closed between two probes, which the block manager keeps (a request
-- frees its blocks tail first, so a chain's tail is evicted before its head).
local function leading_blocks(cmd, key, blob, pos, probe_hs, ok)
  local k = leading(cmd, key, probe_hs, ok, CHUNK)
  if k == #pos then return pos[k] or 0 end
  local lo, hi = pos[k] or 0, pos[k + 1]
  if hi - lo <= 1 then return lo end
  local between = {}
  for p = lo + 1, hi - 1 do between[#between + 1] = p end
  return lo + leading(cmd, key, hashes_at(blob, between), ok, CHUNK)
end
-- Leading probes of `probe_hs` pending in the zset `key` (deadline after `now`), given that
-- the first is, by binary search: a placement records all probes of its chain with one
-- deadline (ZADD GT keeps the latest), so a pending probe's predecessors are pending at least
-- as long. About 7 ZSCOREs for 96 probes; one ZMSCORE of all 96 costs ~40 us (it formats 96
-- doubles), and a hot document is pending on up to half the groups.
local function pending_probes(key, probe_hs, now)
  local lo, hi = 1, #probe_hs
  while lo < hi do
    local mid = math.floor((lo + hi + 1) / 2)
    local r = redis.call('ZSCORE', key, probe_hs[mid])
    if r and tonumber(r) > now then lo = mid else hi = mid - 1 end
  end
  return lo
end
""".replace("DIGEST_SIZE", str(DIGEST_SIZE))
    .replace("PROBE_DENSE", str(PROBE_DENSE))
    .replace("PROBE_STRIDE", str(PROBE_STRIDE))
)

# ARGV: P, group, ttl_ms -> the new epoch.
_REGISTER = """
local g, ttl = ARGV[2], ARGV[3]
drop_registration(g)
local e = redis.call('HINCRBY', P .. 'epochs', g, 1)
redis.call('HSET', P .. 'groups', g, e)
redis.call('SET', P .. 'hb:' .. g, row_head(g, e), 'PX', ttl)
return e
"""

# ARGV: P, group, epoch, ttl_ms [, load_json] -> 1, or 0 when fenced. Heartbeat and load report.
_BEAT = """
local g, e, ttl = ARGV[2], ARGV[3], ARGV[4]
if live_epoch(g) ~= e then return 0 end
if ARGV[5] then redis.call('SET', P .. 'hb:' .. g, row_head(g, e) .. ARGV[5]) end
refresh(g, ttl)
return 1
"""

# ARGV: P, group, epoch, ttl_ms, then events in order: 'S' blob | 'R' blob | 'C'.
_PUBLISH = """
local g, e, ttl = ARGV[2], ARGV[3], ARGV[4]
if live_epoch(g) ~= e then return 0 end
local inv = P .. 'inv:' .. g
local i = 5
while i <= #ARGV do
  local op = ARGV[i]
  if op == 'C' then
    redis.call('DEL', inv)
    i = i + 1
  else
    each_chunk(op == 'S' and 'SADD' or 'SREM', inv, ARGV[i + 1])
    i = i + 2
  end
end
refresh(g, ttl)
return 1
"""

# ARGV: P, group, epoch -> 1 when the registration was dropped.
_DEREGISTER = """
local g, e = ARGV[2], ARGV[3]
if redis.call('HGET', P .. 'groups', g) ~= e then return 0 end
drop_registration(g)
return 1
"""

# ARGV: P -> number of dead groups forgotten.
_CLEANUP = """
local groups = redis.call('HGETALL', P .. 'groups')
local dropped = 0
for i = 1, #groups, 2 do
  local g, e = groups[i], groups[i + 1]
  if live_epoch(g) ~= e then
    drop_registration(g)
    dropped = dropped + 1
  end
end
return dropped
"""

# ARGV: P, group, ttl_ms, blob.
_PENDING = """
local g, ttl, blob = ARGV[2], tonumber(ARGV[3]), ARGV[4]
local k = P .. 'pend:' .. g
local now = now_ms()
redis.call('ZREMRANGEBYSCORE', k, '-inf', now)
local total = #blob / W
-- One score string: a Lua number argument is formatted anew for every entry (~0.5 us each).
local deadline = string.format('%d', now + ttl)
for i = 1, total, CHUNK do
  local args = {}
  for _, h in ipairs(slice(blob, i, math.min(i + CHUNK - 1, total))) do
    args[#args + 1] = deadline
    args[#args + 1] = h
  end
  redis.call('ZADD', k, 'GT', unpack(args))
end
if redis.call('PTTL', k) < ttl then redis.call('PEXPIRE', k, ttl) end
-- The group's latest deadline, so that match skips groups with nothing pending.
local latest = P .. 'pending'
if tonumber(redis.call('HGET', latest, g) or 0) < now + ttl then
  redis.call('HSET', latest, g, now + ttl)
end
if redis.call('PTTL', latest) < ttl then redis.call('PEXPIRE', latest, ttl) end
return 1
"""

# ARGV: P, blob -> one string: a line `group TAB cached TAB pending` per live group that holds
# or has pending the chain's first block, an empty line, then every live group's hb row (see the
# module docstring). Rows change only with a group's load report, so the client keeps the parsed
# rows and parses only the new ones; one bulk string because redis-py parses each element of a
# multi-bulk reply in Python (~3 us apiece). Per live group the script runs one SISMEMBER of the
# first block (~1.5 us); only groups that hold it are probed further.
_MATCH = """
local ids = redis.call('HKEYS', P .. 'groups')
if #ids == 0 then return '' end
local keys = {}
for j, g in ipairs(ids) do keys[j] = P .. 'hb:' .. g end
local live, rows = {}, {}
for j, row in ipairs(redis.call('MGET', unpack(keys))) do
  if row then live[#live + 1], rows[#rows + 1] = ids[j], row end
end
if #live == 0 then return '' end
local blob = ARGV[2]
local n = #blob / W
local counts = {}
if n > 0 then
  local h0, pos, probe_hs, now = string.sub(blob, 1, W), nil, nil, nil
  local latest = redis.call('HMGET', P .. 'pending', unpack(live))
  local function is_member(r) return r == 1 end
  local function is_pending(r) return r and tonumber(r) > now end
  for j, g in ipairs(live) do
    local cached, pending = 0, 0
    local held = redis.call('SISMEMBER', P .. 'inv:' .. g, h0) == 1
    local pend = latest[j] and P .. 'pend:' .. g
    if pend then
      now = now or now_ms()
      pend = tonumber(latest[j]) > now and is_pending(redis.call('ZSCORE', pend, h0)) and pend
    end
    if held or pend then
      pos = pos or probes(n)
      probe_hs = probe_hs or hashes_at(blob, pos)
    end
    if held then
      cached = leading_blocks('SMISMEMBER', P .. 'inv:' .. g, blob, pos, probe_hs, is_member)
    end
    if pend then  -- only probe positions are recorded: no search between them
      pending = pos[pending_probes(pend, probe_hs, now)]
    end
    if cached + pending > 0 then counts[#counts + 1] = g .. '\\t' .. cached .. '\\t' .. pending end
  end
end
return table.concat(counts, '\\n') .. '\\n\\n' .. table.concat(rows, '\\n')
"""

_SCRIPTS = {
    "register": _REGISTER,
    "beat": _BEAT,
    "publish": _PUBLISH,
    "deregister": _DEREGISTER,
    "cleanup": _CLEANUP,
    "pending": _PENDING,
    "match": _MATCH,
}

# Parsed hb rows a client keeps: a few load reports of each of hundreds of groups.
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

    Thread-safe: redis-py's client takes a pooled connection per call.
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
        self._ttl_ms = _ms(self.config.heartbeat_ttl_s)
        self._rows: dict[bytes, GroupMatch] = {}  # hb row -> the group's match of nothing
        # Script objects run EVALSHA and reload the body on NOSCRIPT (e.g. a restarted Redis).
        self._scripts = {
            name: client.register_script(_PRELUDE + body) for name, body in _SCRIPTS.items()
        }

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

    def register_group(self, group_id: str) -> int:
        check_name("group_id", group_id)
        return int(self._run("register", group_id, self._ttl_ms))

    def publish(self, group_id: str, epoch: int, events: Sequence[KVEvent]) -> None:
        result = self._run("publish", group_id, epoch, self._ttl_ms, *_encode_events(events))
        self._fenced("publish", group_id, epoch, result)

    def report_load(self, group_id: str, epoch: int, load: GroupLoad) -> None:
        result = self._run("beat", group_id, epoch, self._ttl_ms, load.to_json())
        self._fenced("report_load", group_id, epoch, result)

    def heartbeat(self, group_id: str, epoch: int) -> None:
        self._fenced("heartbeat", group_id, epoch, self._run("beat", group_id, epoch, self._ttl_ms))

    def deregister(self, group_id: str, epoch: int) -> None:
        self._run("deregister", group_id, epoch)

    def match(self, block_hashes: Sequence[bytes]) -> dict[str, GroupMatch]:
        reply = self._run("match", _blob(block_hashes))
        if not reply:
            return {}
        counts, _, rows = reply.partition(b"\n\n")
        known = self._rows
        out = {}
        for row in rows.split(b"\n"):
            m = known.get(row) or self._parse_row(row)
            out[m.group_id] = m
        for line in counts.split(b"\n") if counts else ():
            gid, cached, pending = line.split(b"\t")
            m = out[gid.decode()]
            out[m.group_id] = GroupMatch(m.group_id, m.epoch, int(cached), int(pending), m.load)
        return out

    def _parse_row(self, row: bytes) -> GroupMatch:
        """A live group's hb row as a match of nothing; kept until the group's load changes."""
        gid, epoch, load = row.split(b"\t", 2)
        m = GroupMatch(gid.decode(), int(epoch), 0, 0, GroupLoad.from_json(load) if load else None)
        if len(self._rows) >= _MAX_ROWS:  # old reports of every group: start over
            self._rows.clear()
        self._rows[row] = m
        return m

    def record_pending(
        self, group_id: str, block_hashes: Sequence[bytes], ttl_s: float | None = None
    ) -> None:
        check_name("group_id", group_id)
        ttl = self.config.pending_ttl_s if ttl_s is None else ttl_s
        if not ttl > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        if block_hashes:
            # Only the probe positions: match never looks at the others (a 2048-block chain
            # writes 96 entries instead of 2048).
            probed = [block_hashes[p] for p in probe_positions(len(block_hashes))]
            self._run("pending", group_id, _ms(ttl), _blob(probed))

    def cleanup(self) -> int:
        return int(self._run("cleanup"))

    def inventory_stats(self) -> InventoryStats:
        """Counts by SCARD/SUNION and bytes by MEMORY USAGE of the groups' `inv` sets.

        `bytes_per_block` is the memory of one (group, block) entry: the sets' MEMORY USAGE
        (estimated from `stats_sample_keys` sampled members each) over the number of entries.
        It does not include pending sets. SUNION copies every hash: not for the hot path.
        """
        c, p = self.client, self.prefix
        with _unavailable_as_index_error():
            groups = c.hgetall(p + "groups")
            heads = {g.decode(): g + b"\t" + e + b"\t" for g, e in groups.items()}
            rows = c.mget([f"{p}hb:{g}" for g in heads]) if heads else []
            live = [
                g for (g, h), r in zip(heads.items(), rows, strict=True) if r and r.startswith(h)
            ]
            inv_keys = [f"{p}inv:{g}" for g in live]
            entries = sum(c.scard(k) for k in inv_keys)
            blocks = len(c.sunion(inv_keys)) if inv_keys else 0
            samples = self.config.stats_sample_keys
            total = sum(c.memory_usage(k, samples=samples) or 0 for k in inv_keys)
        if not entries:
            return InventoryStats(0, 0, len(live))
        return InventoryStats(entries, blocks, len(live), total / entries, total)

    def close(self) -> None:
        self.client.close()

    def _run(self, script: str, *args: object) -> object:
        with _unavailable_as_index_error():
            return self._scripts[script](args=(self.prefix, *args))

    @staticmethod
    def _fenced(what: str, group_id: str, epoch: int, result: object) -> None:
        if result != 1:
            raise StaleEpochError(f"{what}: group {group_id!r} epoch {epoch} is not live")


def _encode_events(events: Sequence[KVEvent]) -> list[str]:
    """The publish script's ARGV tail: 'S' blob | 'R' blob | 'C', in event order."""
    out: list[str | bytes] = []
    for event in events:
        if isinstance(event, BlockStored | BlockRemoved):
            op = "S" if isinstance(event, BlockStored) else "R"
            out += [op, _blob(event.block_hashes)]
        elif isinstance(event, AllBlocksCleared):
            out.append("C")
        else:
            raise TypeError(f"unknown KV event {event!r}")
    return out


def _blob(hashes: Sequence[bytes]) -> bytes:
    """Hashes concatenated into one script argument; each must be DIGEST_SIZE bytes."""
    blob = b"".join(hashes)
    if len(blob) != DIGEST_SIZE * len(hashes):
        raise ValueError(f"block_hashes must all be {DIGEST_SIZE}-byte hashes")
    return blob


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))
