"""Router-side memo of block-hash chains, so a shared document is hashed once, not per request.

A prompt's chain is stored in segments of at most `segment_blocks` full blocks. A segment's
hashes are a pure function of (hash of the block before it, the segment's token bytes): that is
exactly what `BlockHasher.hash_blocks` reads. So the cache is a tree of segments (parent hash,
token bytes, hashes), indexed by parent hash and then by the segment's first block, siblings
always differing in their first block, and walks a prompt from the chain's root:

- one dict lookup on the next block's 64 bytes finds the only candidate; one memcmp of its bytes
  serves it whole (a shared document's chain);
- a candidate shared in part: a binary search over block counts finds how far, its hashes are
  reused and the hasher takes the prompt from the divergence on, in one call; the stored segment
  is then cut there, so the new sibling (a question after a document) hangs beside its rest;
- no candidate: the rest of the prompt goes to the hasher in one call and is stored as new
  segments; a short leaf segment the prompt went through whole (a chat's previous turn) is grown
  first, so a chat keeps one entry per `segment_blocks` blocks.

Runs: when a walk goes through several whole full segments in a row, the first one keeps a run of
them: their token bytes and hashes copied into one span each, so that later walks serve a long
document with one memcmp instead of one lookup and memcmp per segment. A run stays exact whatever
later happens to its segments (cut, evicted): it holds the same pure function's values. It lists
its segments only to refresh them in the LRU, is rebuilt when a walk serves a longer span from its
first segment, is never started where a run missed (two documents behind one shared segment do
not take turns rebuilding it), and is dropped with its first segment.

No key is ever hashed over a segment's 4 KiB of tokens. Every served hash is the value
`hash_blocks` would return, so the chain equals `BlockHasher.hash_prompt`. The root covers the
model, the adapter and the tenant's cache salt, so tenants never share an entry. A prompt's chain
is returned as a `HashChain`: the served hashes' bytes and the new tail's, joined in one copy
(not a list of 2048 hash objects, one reference count each).

What a prompt costs, cold and cached, is measured by `benchmarks/routing.py --latency`
(`hash`; figures in benchmarks/RESULTS.md).

Memory: `num_bytes` counts every segment at a full one's size plus each run's bytes (its copy, and
the objects of evicted segments it still lists: their bytes are freed); LRU eviction over segments
keeps it under `max_bytes`, and a run may take at most a quarter of it. LRU order is refreshed
from the chain's end: a later prompt reaches a segment only through the ones before it, so a
chain's first segment is its most recently used and a chain is evicted from its end (its run,
held by the first segment, last).

Thread safety: the router calls this from its one event loop; a lock still guards the table so
that a call from another thread (a test, a metrics scrape) cannot corrupt it. The long hashing of
a prompt's new tail runs outside the lock; if the tree changed meanwhile, the store walks again.
"""

from __future__ import annotations

import sys
import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from worker.hashing import DIGEST_SIZE, BlockHasher, HashChain

_TOKEN_BYTES = 4  # uint32 per token id, as `worker.hashing` encodes them
_MAX_ROOTS = 4096  # memoised chain roots, one per (adapter, cache salt) seen; then start over


@dataclass(frozen=True)
class HashCacheConfig:
    """Size of the router's hash-chain cache."""

    # Upper bound on the table's memory; 64 MiB holds ~10M tokens of prefixes at block size 16.
    max_bytes: int = 64 * 1024 * 1024
    # Blocks per cached segment: one memcmp and one LRU entry each. A partly shared segment
    # reuses its shared blocks, so the size trades probes per prompt against eviction grain.
    segment_blocks: int = 64

    def __post_init__(self) -> None:
        if not isinstance(self.max_bytes, int) or self.max_bytes < 0:
            raise ValueError(f"max_bytes must be a non-negative int, got {self.max_bytes!r}")
        if not isinstance(self.segment_blocks, int) or self.segment_blocks < 1:
            raise ValueError(f"segment_blocks must be a positive int, got {self.segment_blocks!r}")


@dataclass
class HashCacheStats:
    """Counters since construction: blocks served from the table vs hashed by the hasher."""

    cached_blocks: int = 0
    hashed_blocks: int = 0
    evictions: int = 0
    run_hits: int = 0  # walks that served several segments with one memcmp


class _Segment:
    """Up to `segment_blocks` stored blocks; hashed by identity (its place in the LRU)."""

    __slots__ = ("parent", "data", "blob", "last", "run")

    def __init__(self, parent: bytes, data: bytes, blob: bytes) -> None:
        self.parent = parent  # hash of the block before the segment (or the chain's root)
        self.data = data  # (blocks * block_size,) uint32 token ids as bytes
        self.blob = blob  # (blocks * DIGEST_SIZE,) one hash per full block, oldest first
        self.last = blob[-DIGEST_SIZE:]  # its children's parent
        self.run: _Run | None = None  # the whole full segments a walk went through from here


# what an evicted segment listed in a run still holds: the object and its parent hash
_PINNED_BYTES = sys.getsizeof(_Segment(b"", b"", bytes(DIGEST_SIZE))) + sys.getsizeof(bytes(DIGEST_SIZE))


class _Run:
    """Several whole full segments in a row, copied into one span: one memcmp serves them all.
    Hashes are a pure function of (parent, tokens), so a run stays exact whatever later happens
    to its segments; they are listed only to refresh them in the LRU."""

    __slots__ = ("data", "blob", "last", "nodes", "size")

    def __init__(self, data: bytes, blob: bytes, nodes: list[_Segment]) -> None:
        self.data, self.blob, self.last, self.nodes = data, blob, blob[-DIGEST_SIZE:], nodes
        # its own bytes, plus what the segments it lists keep once evicted (their data is freed)
        parts = (self, data, blob, self.last, nodes)
        self.size = sum(map(sys.getsizeof, parts)) + len(nodes) * _PINNED_BYTES


class PrefixHashCache:
    """`hash_prompt` with the same result as `BlockHasher.hash_prompt`, memoised per segment."""

    def __init__(self, hasher: BlockHasher, config: HashCacheConfig | None = None) -> None:
        self.hasher = hasher
        self.config = config or HashCacheConfig()
        self.stats = HashCacheStats()
        self._block_bytes = hasher.block_size * _TOKEN_BYTES
        self._segment_bytes = self.config.segment_blocks * self._block_bytes
        # parent hash -> {first block's bytes: the segment stored after it}: siblings differ in
        # their first block, so one dict lookup finds the only candidate
        self._children: dict[bytes, dict[bytes, _Segment]] = {}
        self._lru: OrderedDict[_Segment, None] = OrderedDict()  # least recently used first
        self._roots: dict[tuple[str | None, str | None], bytes] = {}  # (adapter, salt) -> root
        self._lock = threading.Lock()
        self._version = 0  # bumped by every change of the tree; a walk is valid while it holds
        self._run_bytes = 0  # held by the runs (`_Run.size` each), counted in the bound
        self.entry_bytes = _entry_bytes(self._segment_bytes, self.config.segment_blocks)
        self.max_entries = self.config.max_bytes // self.entry_bytes

    def __len__(self) -> int:
        return len(self._lru)

    @property
    def num_bytes(self) -> int:
        """Estimated memory held by the table: every entry at a full segment's size, and runs."""
        return len(self._lru) * self.entry_bytes + self._run_bytes

    def clear(self) -> None:
        """Drops every entry (e.g. when the cluster secret or model changes)."""
        with self._lock:
            self._children.clear()
            self._lru.clear()
            self._roots.clear()
            self._run_bytes = 0
            self._version += 1

    def hash_prompt(
        self,
        token_ids: Sequence[int],
        adapter_id: str | None = None,
        cache_salt: str | None = None,
    ) -> HashChain:
        """The whole chain of a prompt's full blocks, equal to `hasher.hash_prompt(...)`."""
        ids = _as_uint32(token_ids)
        raw = ids.tobytes()  # one copy; every compare below is a memcmp against it
        end = len(ids) // self.hasher.block_size * self._block_bytes  # bytes of the full blocks
        parts: list[bytes] = []  # the chain's hashes served from stored segments
        used: list[_Segment] = []  # the stored segments the chain went through, in order
        with self._lock:
            root = self._root(adapter_id, cache_salt)
            stop = self._walk(raw, end, root, parts, used)
            version = self._version
        a, parent = stop[0], stop[1]  # blocks from byte a on (after `parent`) are not stored
        tail = b"".join(self.hasher.hash_blocks(ids, parent, a // self._block_bytes))
        self.stats.cached_blocks += a // self._block_bytes
        self.stats.hashed_blocks += len(tail) // DIGEST_SIZE
        parts.append(tail)
        chain = b"".join(parts)
        if self.max_entries:
            with self._lock:
                if tail and self._version != version:  # another thread changed the tree
                    stop = self._walk(raw, end, root, [], [])
                new = self._store(raw, chain, *stop) if stop[0] < end else []
                self._refresh(used, new)
        return HashChain(chain)

    def _root(self, adapter_id: str | None, cache_salt: str | None) -> bytes:
        key = (adapter_id, cache_salt)
        root = self._roots.get(key)
        if root is None:
            if len(self._roots) >= _MAX_ROOTS:
                self._roots.clear()
            root = self._roots[key] = self.hasher.root(adapter_id, cache_salt)
        return root

    def _walk(
        self, raw: bytes, end: int, parent: bytes, parts: list[bytes], used: list[_Segment]
    ) -> tuple[int, bytes, _Segment | None, int]:
        """Appends to `parts` the hashes served by stored segments, from the root on. Returns the
        first byte not served, the hash before it, the last segment the walk went through (None
        if none, or a run) and how many of that segment's blocks the prompt shares."""
        get, bb, full = self._children.get, self._block_bytes, self._segment_bytes
        a, node, k = 0, None, 0
        span = None  # (first, its index in used, in parts, its byte) of whole full segments
        while a < end:
            siblings = get(parent)
            nxt = siblings.get(raw[a : a + bb]) if siblings else None  # by its first block
            if nxt is None:
                break
            run = nxt.run
            if run is not None and raw.startswith(run.data, a):  # a document: one memcmp
                span = span or (nxt, len(used), len(parts), a)
                used += run.nodes
                parts.append(run.blob)
                parent, node, k = run.last, None, 0  # its last segment may have changed since
                a += len(run.data)
                self.stats.run_hits += 1
                continue
            node = nxt
            whole = raw.startswith(node.data, a)  # the usual case: one memcmp serves it
            if span is not None and not (whole and len(node.data) == full):
                self._remember(span, raw[span[3] : a], parts, used)
                span = None
            used.append(node)
            if whole:
                if span is None and run is None and len(node.data) == full:
                    span = (node, len(used) - 1, len(parts), a)  # not where a run missed
                parts.append(node.blob)
                parent, k = node.last, len(node.blob) // DIGEST_SIZE
                a += len(node.data)
                continue
            n = min(len(node.data), end - a) // bb  # blocks of it the prompt could share
            k = _shared_blocks(node.data, raw[a : a + n * bb], 1, n, bb)
            parts.append(node.blob[: k * DIGEST_SIZE])
            return a + k * bb, node.blob[(k - 1) * DIGEST_SIZE : k * DIGEST_SIZE], node, k
        if span is not None:
            self._remember(span, raw[span[3] : a], parts, used)
        return a, parent, node, k

    def _remember(self, span: tuple, data: bytes, parts: list[bytes], used: list[_Segment]) -> None:
        """Gives the span's first segment a run of the span (`data`, from the prompt) if it
        covers several segments and more than the segment's run."""
        first, i, j, _ = span
        if len(used) - i < 2 or 4 * len(data) > self.config.max_bytes:  # at most a quarter
            return
        if first.run is None or len(first.run.data) < len(data):
            self._drop_run(first)
            first.run = _Run(data, b"".join(parts[j:]), used[i:])
            self._run_bytes += first.run.size

    def _drop_run(self, node: _Segment) -> None:
        if node.run is not None:
            self._run_bytes -= node.run.size
            node.run = None

    def _store(self, raw: bytes, chain: bytes, a: int, parent: bytes, node: _Segment | None, k: int) -> list[_Segment]:
        """Stores the blocks from raw[a:] on (hashes in `chain`), after the walk's last segment
        `node`: cut `node` where the prompt diverges from it, or grow it if it is a short leaf (a
        chat's previous turn), then new segments. Returns the new segments, oldest block first."""
        bb, w, seg = self._block_bytes, DIGEST_SIZE, self.config.segment_blocks
        new = []
        self._version += 1
        if node is not None and k < len(node.blob) // w:
            new.append(self._cut(node, k))
        elif node is not None and k < seg and parent not in self._children:
            grow = min(seg - k, (len(chain) // w) - a // bb)
            node.data += raw[a : a + grow * bb]
            node.blob += chain[a // bb * w : (a // bb + grow) * w]
            node.last = parent = node.blob[-w:]
            a += grow * bb
        new += self._split(raw, a, parent, chain[a // bb * w :])
        return new

    def _cut(self, node: _Segment, k: int) -> _Segment:
        """Keeps `node`'s first k blocks in it and moves the rest (and their children) to a new
        segment after them, so that a sibling diverging at block k can be stored beside it."""
        bb, w = self._block_bytes, DIGEST_SIZE
        rest = _Segment(node.blob[(k - 1) * w : k * w], node.data[k * bb :], node.blob[k * w :])
        node.data, node.blob = node.data[: k * bb], node.blob[: k * w]
        node.last = rest.parent
        return rest

    def _split(self, raw: bytes, a: int, parent: bytes, blob: bytes) -> list[_Segment]:
        """New segments holding the hashes in `blob`, those of the blocks from raw[a:] on (the
        first one after `parent`); one huge prompt keeps its leading segments only."""
        seg, bb, w = self.config.segment_blocks, self._block_bytes, DIGEST_SIZE
        nodes = []
        for j in range(0, min(len(blob) // w, self.max_entries * seg), seg):
            part = blob[j * w : (j + seg) * w]  # the last segment may hold fewer blocks
            data = raw[a + j * bb : a + (j + len(part) // w) * bb]
            nodes.append(_Segment(blob[(j - 1) * w : j * w] if j else parent, data, part))
        return nodes

    def _refresh(self, used: list[_Segment], new: list[_Segment]) -> None:
        """Stores a prompt's new segments and refreshes its stored ones, deepest first (new ones
        come after every stored one), so that a chain's first segment is its most recently used;
        then evicts down to the bound."""
        lru, move, add = self._lru, self._lru.move_to_end, self._add
        for node in reversed(new):
            add(node)
        for node in reversed(used):
            if node in lru:  # else evicted by another thread
                move(node)
        while lru and self.num_bytes > self.config.max_bytes:
            self._unlink(lru.popitem(last=False)[0])
            self.stats.evictions += 1
            self._version += 1

    def _add(self, node: _Segment) -> None:
        key = node.data[: self._block_bytes]
        old = self._children.get(node.parent, {}).get(key)
        if old is not None:  # only after a race left an orphan (its parent evicted) in the way
            del self._lru[old]
            self._unlink(old)
        self._children.setdefault(node.parent, {})[key] = node
        self._lru[node] = None

    def _unlink(self, node: _Segment) -> None:
        """Removes a segment gone from the LRU from its parent's children, drops its run and
        frees its bytes (runs that list it keep only the object)."""
        siblings = self._children.get(node.parent)
        key = node.data[: self._block_bytes]
        if siblings is not None and siblings.get(key) is node:
            del siblings[key]
            if not siblings:
                del self._children[node.parent]
        self._drop_run(node)
        node.data = node.blob = node.last = b""


def _as_uint32(token_ids: Sequence[int]) -> array:
    if isinstance(token_ids, array) and token_ids.typecode == "I":
        return token_ids  # already converted (the router's vocabulary check does)
    try:
        return array("I", token_ids)  # (num_tokens,) uint32, one conversion for all
    except OverflowError as e:
        raise ValueError("token ids must be in [0, 2**32)") from e


def _shared_blocks(data: bytes, seg: bytes, lo: int, hi: int, bb: int) -> int:
    """The most blocks in [lo, hi] that `data` and `seg` share, given that lo blocks match.
    Each compare covers only blocks not yet known to match."""
    if data.startswith(seg[lo * bb : hi * bb], lo * bb):
        return hi  # the usual case for a partial last segment
    hi -= 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if data.startswith(seg[lo * bb : mid * bb], lo * bb):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _entry_bytes(segment_bytes: int, segment_blocks: int) -> int:
    """Bytes one full segment holds: the segment object, its token bytes, its hashes' bytes and
    its parent's and last hash, plus its LRU slot and link node and its entry in its siblings'
    dict."""
    digest = sys.getsizeof(bytes(DIGEST_SIZE))
    node = sys.getsizeof(_Segment(b"", b"", bytes(DIGEST_SIZE))) + sys.getsizeof(bytes(segment_bytes))
    hashes = sys.getsizeof(bytes(segment_blocks * DIGEST_SIZE)) + 2 * digest  # blob, parent, last
    return node + hashes + 160
