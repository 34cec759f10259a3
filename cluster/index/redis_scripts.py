"""The Lua scripts of the Redis prefix index (cluster/index/redis_index.py is the Python side).

Data layout; every key starts with P = `pf:<cluster>:<model>:`; block hashes are stored as their
raw 16 bytes (set members, hash fields and script arguments are binary-safe):

    P epochs          hash  group -> last epoch handed out (HINCRBY; never shrinks)
    P groups          hash  group -> epoch of its current registration
    P hb:<group>      string  the group's row of the match reply, `group TAB epoch TAB`,
                      PX heartbeat_ttl
    P inv:<group>     set   every block hash the current registration caches, PX heartbeat_ttl
    P host:<group>    set   every block hash its host tier holds, PX heartbeat_ttl
    P disk:<group>    set   every block hash its disk tier holds, PX heartbeat_ttl
    P pendh           hash  block hash .. `group TAB epoch TAB` -> deadline (Redis TIME, ms)
    P pendq           zset  the same members, scored by their deadline, PX the longest pending TTL
    P log             stream  every change above, in order (see "The log" below), MAXLEN ~LOG_MAX
    P logseq          string  the sequence number of the log's last entry

A group is live while `hb:<group>` exists and starts with `group TAB groups[group] TAB` (its
"head"). Each heartbeat or publish refreshes the TTLs of hb and inv together, so when a group
dies its keys expire by themselves; `cleanup()` only forgets its `groups` field. One MGET of
the hb rows answers liveness and epoch for every group. (How busy a group is does not go
through the index: a router reads it from the group's own status.)

Pending placements are one hash for all groups, keyed by (probe hash, registration head), so
that one HMGET asks every group at once; a new registration has a new head, so an old one's
entries never match again. `pendq` lets each pending write drop the expired entries (Redis 7.0
has no per-field expiry). Only a chain's probe positions are recorded (see `probes`).

`match` is one EVALSHA whose argument is the chain's hashes concatenated. The script reads
`groups` (HKEYS) and every hb row (one MGET), then asks each live group one SISMEMBER of the
chain's first block: a group that does not hold it holds none of the chain. A
group that holds it gets one SMISMEMBER of all the chain's probe positions (every block up to
32, then every 32nd, then the last) and one of the blocks between the last probe hit and the
first miss. A group with a lower tier (its `host` or `disk` set exists) is asked the same of
the union of its device and host sets, then of all three: the chain's blocks past the device's
lead that the host restores, then those the disk adds (as the in-process copy counts them). Pending: one HMGET of the first block for every live group, then a binary search
for each group's last pending probe, run for all those groups together: one HMGET per step
(about 7 for 96 probes), where a binary search per group in per-group zsets would make a
redis.call per group and step (benchmarks/RESULTS.md).

The log: every script that changes what a match answers also appends one entry per change to
`log`, a stream with one field `v` = `kind TAB seq TAB group TAB epoch TAB payload`, where seq is
`INCR logseq`. Kinds: G register, D deregister, B heartbeat (no payload),
S / R blocks stored / removed on the device, SH / RH on the host tier, SD / RD on the disk
tier (payload: their hashes concatenated), C cleared (every tier), Q pending (payload:
`ttl_ms TAB probe hashes`). A router's mirror (cluster/index/mirror.py) loads a `snapshot`, then
follows the log from the snapshot's seq; a seq that is not the next one (the log was trimmed, or
Redis restarted and lost it) sends it back to the snapshot. Both log keys expire after an hour
without writes, so an abandoned cluster leaves nothing behind.

Every write script first checks that (group, epoch) is live, so a group restarted under a new
epoch fences off its old process. Scripts compute key names from P, so all keys of one index must
live on one Redis (a single server or a replicated primary, not Redis Cluster).
"""

from __future__ import annotations

from cluster.index.probes import PROBE_DENSE, PROBE_STRIDE
from worker.hashing import DIGEST_SIZE

# The log keeps about this many entries: a mirror that falls further behind reloads a snapshot.
LOG_MAX_ENTRIES = 100_000
LOG_TTL_MS = 3_600_000

# Shared by every script: ARGV[1] is the key prefix P. A chain travels as one argument, its
# 16-byte hashes concatenated (packing thousands of arguments costs redis-py more than the whole
# match costs Redis). `unpack` is bounded by Lua's C stack (about 8000 values), hence CHUNK.
PRELUDE = (
    """
local P = ARGV[1]
local CHUNK = 1024
local W = DIGEST_SIZE
local PENDH, PENDQ = P .. 'pendh', P .. 'pendq'
local LOG, LOGSEQ = P .. 'log', P .. 'logseq'
-- One log entry (see the module docstring); `payload` may be binary.
local function log(kind, g, e, payload)
  local seq = redis.call('INCR', LOGSEQ)
  redis.call('XADD', LOG, 'MAXLEN', '~', LOG_MAX, '*', 'v',
    kind .. '\\t' .. seq .. '\\t' .. g .. '\\t' .. e .. '\\t' .. (payload or ''))
  redis.call('PEXPIRE', LOG, LOG_TTL_MS)
  redis.call('PEXPIRE', LOGSEQ, LOG_TTL_MS)
end
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
-- Pending entries are keyed by the registration's head: a new epoch never sees them.
local function drop_registration(g)
  redis.call('HDEL', P .. 'groups', g)
  redis.call('DEL', P .. 'hb:' .. g, P .. 'inv:' .. g, P .. 'host:' .. g, P .. 'disk:' .. g)
end
local function refresh(g, ttl)
  for _, k in ipairs({'hb:', 'inv:', 'host:', 'disk:'}) do redis.call('PEXPIRE', P .. k .. g, ttl) end
end
-- A publish op's set: S/R the device's `inv`, SH/RH the host's, SD/RD the disk's.
local TIER_KEY = {S = 'inv:', R = 'inv:', SH = 'host:', RH = 'host:', SD = 'disk:', RD = 'disk:'}
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
-- How many leading hashes of the list `hs` are members of one of the sets `keys`, asked
-- in chunks of `size` hashes (one SMISMEMBER per set), then twice as many, ...
local function leading(keys, hs, size)
  local n, i = 0, 1
  while i <= #hs do
    local last = math.min(i + size - 1, #hs)
    local replies = redis.call('SMISMEMBER', keys[1], unpack(hs, i, last))
    for k = 2, #keys do
      for j, r in ipairs(redis.call('SMISMEMBER', keys[k], unpack(hs, i, last))) do
        if r == 1 then replies[j] = 1 end
      end
    end
    for _, r in ipairs(replies) do
      if r ~= 1 then return n end
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
-- Leading blocks of the chain held in the union of the sets `keys`, known to hold the first
-- block: all probes in one call per set (one call per chunk costs more than the lookups), then
-- the blocks between the last probe hit and the first probe miss. Exact within the first DENSE
-- blocks; beyond, exact when the holdings are prefix-closed between two probes, which the block
-- manager keeps (a request frees its blocks tail first, so a chain's tail is evicted before its
-- head).
local function leading_blocks(keys, blob, pos, probe_hs)
  local k = leading(keys, probe_hs, CHUNK)
  if k == #pos then return pos[k] or 0 end
  local lo, hi = pos[k] or 0, pos[k + 1]
  if hi - lo <= 1 then return lo end
  local between = {}
  for p = lo + 1, hi - 1 do between[#between + 1] = p end
  return lo + leading(keys, hashes_at(blob, between), CHUNK)
end
""".replace("DIGEST_SIZE", str(DIGEST_SIZE))
    .replace("PROBE_DENSE", str(PROBE_DENSE))
    .replace("PROBE_STRIDE", str(PROBE_STRIDE))
    .replace("LOG_MAX", str(LOG_MAX_ENTRIES))
    .replace("LOG_TTL_MS", str(LOG_TTL_MS))
)

# ARGV: P, group, ttl_ms [, previous] -> the new epoch, or 0 when refused. `previous` is the
# epoch the caller held (0 or absent: a new start, which takes over unconditionally). A caller
# re-registering after its registration lapsed is refused once a later epoch was handed out: a
# newer process fenced it off, and it must not take the group back (an old epoch's takeover,
# answered by the new one's, would hand out epochs without end). A `previous` beyond the counter
# (Redis lost its keys) raises the counter first, so epochs keep growing.
REGISTER = """
local g, ttl, prev = ARGV[2], ARGV[3], tonumber(ARGV[4] or 0)
local last = tonumber(redis.call('HGET', P .. 'epochs', g) or 0)
if prev > 0 and last > prev then return 0 end
if prev > last then redis.call('HSET', P .. 'epochs', g, prev) end
drop_registration(g)
local e = redis.call('HINCRBY', P .. 'epochs', g, 1)
redis.call('HSET', P .. 'groups', g, e)
redis.call('SET', P .. 'hb:' .. g, row_head(g, e), 'PX', ttl)
log('G', g, e)
return e
"""

# ARGV: P, group, epoch, ttl_ms -> 1, or 0 when fenced. Heartbeat.
BEAT = """
local g, e, ttl = ARGV[2], ARGV[3], ARGV[4]
if live_epoch(g) ~= e then return 0 end
refresh(g, ttl)
log('B', g, e)
return 1
"""

# ARGV: P, group, epoch, ttl_ms, then events in order: op blob (op: S / R on the device, SH / RH
# on the host tier, SD / RD on the disk tier) | 'C' (every tier cleared).
PUBLISH = """
local g, e, ttl = ARGV[2], ARGV[3], ARGV[4]
if live_epoch(g) ~= e then return 0 end
local i = 5
while i <= #ARGV do
  local op = ARGV[i]
  if op == 'C' then
    redis.call('DEL', P .. 'inv:' .. g, P .. 'host:' .. g, P .. 'disk:' .. g)
    log('C', g, e)
    i = i + 1
  else
    local key = P .. TIER_KEY[op] .. g
    each_chunk(string.sub(op, 1, 1) == 'S' and 'SADD' or 'SREM', key, ARGV[i + 1])
    log(op, g, e, ARGV[i + 1])
    i = i + 2
  end
end
refresh(g, ttl)
if #ARGV < 5 then log('B', g, e) end  -- no events: a mirror still sees the beat
return 1
"""

# ARGV: P, group, epoch -> 1 when the registration was dropped.
DEREGISTER = """
local g, e = ARGV[2], ARGV[3]
if redis.call('HGET', P .. 'groups', g) ~= e then return 0 end
drop_registration(g)
log('D', g, e)
return 1
"""

# ARGV: P -> number of dead groups forgotten.
CLEANUP = """
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

# ARGV: P, ttl_ms, then per placement: group, fresh, blob of the chain's probe hashes -> the
# number of entries written. Match's binary search needs a probe's deadline never later than
# its predecessor's. A full write gives every probe now + ttl, never shortening an entry (like
# ZADD GT). `fresh` > 0 says the writer recorded the first `fresh` probes less than half a TTL
# ago: if probe `fresh` is still pending, only the later probes are written, with its deadline
# (so the order holds, and a placement on a hot document writes its new tail, not the document).
# Otherwise (expired, or Redis lost it) the write is full. Each rule only raises deadlines along
# a chain from its head, so concurrent writers from several routers keep the order too.
PENDING = """
local ttl = tonumber(ARGV[2])
local now = now_ms()
-- Drop expired entries first (bounded work; the rest go with the next writes).
for _ = 1, 8 do
  local old = redis.call('ZRANGEBYSCORE', PENDQ, '-inf', now, 'LIMIT', 0, CHUNK)
  if #old == 0 then break end
  redis.call('HDEL', PENDH, unpack(old))
  redis.call('ZREM', PENDQ, unpack(old))
  if #old < CHUNK then break end
end
local written = 0
local function write(fields, deadline)
  local old = redis.call('HMGET', PENDH, unpack(fields))
  local score = string.format('%d', deadline)  -- one string: formatting per entry costs
  local hs, zs = {}, {}
  for i, f in ipairs(fields) do
    if not old[i] or tonumber(old[i]) < deadline then
      hs[#hs + 1], hs[#hs + 2] = f, score
      zs[#zs + 1], zs[#zs + 2] = score, f
    end
  end
  if #hs > 0 then
    redis.call('HSET', PENDH, unpack(hs))
    redis.call('ZADD', PENDQ, unpack(zs))
    written = written + #hs / 2
  end
end
for i = 3, #ARGV, 3 do
  local g, fresh, blob = ARGV[i], tonumber(ARGV[i + 1]), ARGV[i + 2]
  local e = live_epoch(g)  -- a lapsed registration takes no placements
  if e then
    local head, deadline = row_head(g, e), now + ttl
    if fresh > 0 then
      local ref = string.sub(blob, (fresh - 1) * W + 1, fresh * W) .. head
      local d = tonumber(redis.call('HGET', PENDH, ref) or 0)
      if d > now then deadline = math.min(deadline, d) else fresh = 0 end
    end
    local total = #blob / W
    for first = fresh + 1, total, CHUNK do
      local fields = slice(blob, first, math.min(first + CHUNK - 1, total))
      for j, h in ipairs(fields) do fields[j] = h .. head end
      write(fields, deadline)
    end
    if total > fresh then
      log('Q', g, e, string.format('%d', deadline - now) .. '\\t' .. string.sub(blob, fresh * W + 1))
    end
  end
end
for _, k in ipairs({PENDH, PENDQ}) do
  if redis.call('PTTL', k) < ttl then redis.call('PEXPIRE', k, ttl) end
end
return written
"""

# ARGV: P, blob -> one string: a line `group TAB cached TAB pending [TAB host TAB disk]` per live
# group that holds (in any tier) or has pending the chain's first block, an empty line, then every live group's hb row (see the
# module docstring). Rows change only with a group's registration, so the client keeps the
# parsed rows and parses only the new ones; one bulk string because redis-py parses each element of a
# multi-bulk reply in Python.
MATCH = """
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
local cached, pending, counts, below = {}, {}, {}, {}
if n > 0 then
  local h0, pos, probe_hs = string.sub(blob, 1, W), nil, nil
  for j, g in ipairs(live) do
    local inv, host, disk = P .. 'inv:' .. g, P .. 'host:' .. g, P .. 'disk:' .. g
    local on_device = redis.call('SISMEMBER', inv, h0) == 1
    if on_device then
      pos = pos or probes(n)
      probe_hs = probe_hs or hashes_at(blob, pos)
      cached[j] = leading_blocks({inv}, blob, pos, probe_hs)
    end
    if redis.call('EXISTS', host, disk) > 0 then
      local on_host = redis.call('SISMEMBER', host, h0) == 1
      if on_device or on_host or redis.call('SISMEMBER', disk, h0) == 1 then
        pos = pos or probes(n)
        probe_hs = probe_hs or hashes_at(blob, pos)
        local d = cached[j] or 0
        local u = d
        if on_device or on_host then u = math.max(d, leading_blocks({inv, host}, blob, pos, probe_hs)) end
        local a = math.max(u, leading_blocks({inv, host, disk}, blob, pos, probe_hs))
        if a > d then below[j] = (u - d) .. '\\t' .. (a - u) end
      end
    end
  end
  if redis.call('EXISTS', PENDH) == 1 then
    local heads, fields, lo, hi, now = {}, {}, {}, {}, now_ms()
    for j, row in ipairs(rows) do  -- the registration's head ends at the row's second TAB
      heads[j] = string.sub(row, 1, string.find(row, '\\t', #live[j] + 2, true))
      fields[j] = h0 .. heads[j]
    end
    local searching = {}
    for j, d in ipairs(redis.call('HMGET', PENDH, unpack(fields))) do
      if d and tonumber(d) > now then searching[#searching + 1] = j end
    end
    if #searching > 0 then
      pos = pos or probes(n)
      probe_hs = probe_hs or hashes_at(blob, pos)
      for _, j in ipairs(searching) do lo[j], hi[j] = 1, #pos end
    end
    -- Every searching group at once: probe lo[j] is pending, those after hi[j] are not.
    while #searching > 0 do
      local asked, mids, next_round = {}, {}, {}
      for i, j in ipairs(searching) do
        mids[i] = math.floor((lo[j] + hi[j] + 1) / 2)
        asked[i] = probe_hs[mids[i]] .. heads[j]
      end
      for i, d in ipairs(redis.call('HMGET', PENDH, unpack(asked))) do
        local j = searching[i]
        if d and tonumber(d) > now then lo[j] = mids[i] else hi[j] = mids[i] - 1 end
        if lo[j] < hi[j] then next_round[#next_round + 1] = j end
      end
      searching = next_round
    end
    for j, l in pairs(lo) do pending[j] = pos[l] end
  end
  for j, g in ipairs(live) do
    local c, p = cached[j] or 0, pending[j] or 0
    if below[j] then
      counts[#counts + 1] = g .. '\\t' .. c .. '\\t' .. p .. '\\t' .. below[j]
    elseif c + p > 0 then
      counts[#counts + 1] = g .. '\\t' .. c .. '\\t' .. p
    end
  end
end
return table.concat(counts, '\\n') .. '\\n\\n' .. table.concat(rows, '\\n')
"""

# ARGV: P -> {seq, the log's last entry id or '0-0', then per live group: group, epoch, the ms
# its registration has left (a mirror must not keep a dead group live a whole TTL past the
# snapshot), its device, host and disk inventories' hashes concatenated (three strings); last, a list of the live registrations' unexpired pending probes as lines
# `group TAB epoch TAB ttl_ms TAB hash`}. Consistent with the log at `seq` (a script runs alone):
# a mirror that loads it follows the log from entry seq + 1.
SNAPSHOT = """
local seq = tonumber(redis.call('GET', LOGSEQ) or 0)
local tail = redis.call('XREVRANGE', LOG, '+', '-', 'COUNT', 1)
local out, heads = {seq, tail[1] and tail[1][1] or '0-0'}, {}
for _, g in ipairs(redis.call('HKEYS', P .. 'groups')) do
  local e = live_epoch(g)
  if e then
    heads[row_head(g, e)] = true
    out[#out + 1] = g
    out[#out + 1] = e
    out[#out + 1] = redis.call('PTTL', P .. 'hb:' .. g)
    for _, k in ipairs({'inv:', 'host:', 'disk:'}) do
      out[#out + 1] = table.concat(redis.call('SMEMBERS', P .. k .. g))
    end
  end
end
-- Pending: `head TAB ttl_ms TAB hash` lines of every live registration (the hash is last: binary).
local now, pend = now_ms(), {}
for _, f in ipairs(redis.call('ZRANGEBYSCORE', PENDQ, '(' .. now, '+inf')) do
  local head = string.sub(f, W + 1)
  if heads[head] then
    local d = tonumber(redis.call('HGET', PENDH, f) or 0)
    if d > now then pend[#pend + 1] = head .. (d - now) .. '\\t' .. string.sub(f, 1, W) end
  end
end
out[#out + 1] = pend
return out
"""

SCRIPTS = {
    "register": REGISTER,
    "beat": BEAT,
    "publish": PUBLISH,
    "deregister": DEREGISTER,
    "cleanup": CLEANUP,
    "pending": PENDING,
    "match": MATCH,
    "snapshot": SNAPSHOT,
}
