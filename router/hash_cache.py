"""Router-side memo of block-hash chains, so a shared document is hashed once, not per request.

A prompt's chain is cut into segments of `segment_blocks` full blocks. A segment's hashes are a
pure function of (hash of the block before it, the segment's token bytes): that is exactly what
`BlockHasher.hash_blocks` reads. So the cache maps that pair to the segment's hashes and walks a
prompt segment by segment from the chain's root: every hit is the value `hash_blocks` would
return, and the first miss hands the rest of the prompt to the hasher. The root covers the model,
the adapter and the tenant's cache salt, so tenants never share an entry.

Cost of a hit on a 32k-token prompt with the default 64-block segments of 16 tokens: one array
conversion of the ids and 32 dictionary probes over 4 KiB keys, instead of 2048 keyed BLAKE2b
calls.

Thread safety: the router calls this from its one event loop; a lock still guards the table so
that a call from another thread (a test, a metrics scrape) cannot corrupt the LRU order.
"""

from __future__ import annotations

import sys
import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from worker.hashing import DIGEST_SIZE, BlockHasher

_TOKEN_BYTES = 4  # uint32 per token id, as `worker.hashing` encodes them


@dataclass(frozen=True)
class HashCacheConfig:
    """Size of the router's hash-chain cache."""

    # Upper bound on the table's memory, keys and values counted; 64 MiB holds ~8M tokens of
    # prefixes at block size 16.
    max_bytes: int = 64 * 1024 * 1024
    # Blocks per cached segment. Larger: fewer probes per prompt but up to segment_blocks - 1
    # blocks of a shared prefix re-hashed at its end; 64 blocks of 16 tokens is a 4 KiB key.
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


class PrefixHashCache:
    """`hash_prompt` with the same result as `BlockHasher.hash_prompt`, memoised per segment."""

    def __init__(self, hasher: BlockHasher, config: HashCacheConfig | None = None) -> None:
        self.hasher = hasher
        self.config = config or HashCacheConfig()
        self.stats = HashCacheStats()
        bs = hasher.block_size
        self._segment_tokens = self.config.segment_blocks * bs
        self._segment_key_bytes = self._segment_tokens * _TOKEN_BYTES
        # (parent hash, segment token bytes) -> the segment's block hashes, oldest first.
        self._table: OrderedDict[tuple[bytes, bytes], list[bytes]] = OrderedDict()
        self._lock = threading.Lock()
        self.entry_bytes = _entry_bytes(self._segment_key_bytes, self.config.segment_blocks)
        self.max_entries = self.config.max_bytes // self.entry_bytes

    def __len__(self) -> int:
        return len(self._table)

    @property
    def num_bytes(self) -> int:
        """Estimated memory held by the table (every entry has the same shape)."""
        return len(self._table) * self.entry_bytes

    def clear(self) -> None:
        """Drops every entry (e.g. when the cluster secret or model changes)."""
        with self._lock:
            self._table.clear()

    def hash_prompt(
        self,
        token_ids: Sequence[int],
        adapter_id: str | None = None,
        cache_salt: str | None = None,
    ) -> list[bytes]:
        """The whole chain of a prompt's full blocks, equal to `hasher.hash_prompt(...)`."""
        if isinstance(token_ids, array) and token_ids.typecode == "I":
            ids = token_ids  # already converted (the router's vocabulary check does)
        else:
            try:
                ids = array("I", token_ids)  # (num_tokens,) uint32, one conversion for all
            except OverflowError as e:
                raise ValueError("token ids must be in [0, 2**32)") from e
        raw = ids.tobytes()
        step, seg_blocks = self._segment_key_bytes, self.config.segment_blocks
        num_segments = len(ids) // self._segment_tokens
        parent = self.hasher.root(adapter_id, cache_salt)
        chain: list[bytes] = []
        hit_keys = self._walk_cached(raw, parent, num_segments, chain)
        done = len(hit_keys)
        if done:
            parent = chain[-1]
        tail = self.hasher.hash_blocks(ids, parent, done * seg_blocks)
        self.stats.cached_blocks += len(chain)
        self.stats.hashed_blocks += len(tail)
        # Remember the newly hashed full segments; a partial last segment is never stored.
        new = [
            (
                (tail[j * seg_blocks - 1] if j else parent, raw[s * step : (s + 1) * step]),
                tail[j * seg_blocks : (j + 1) * seg_blocks],
            )
            for j, s in enumerate(range(done, num_segments))
        ]
        self._insert(new, hit_keys)
        chain += tail
        return chain

    def _walk_cached(self, raw: bytes, parent: bytes, num_segments: int, chain: list) -> list:
        """Appends the cached leading segments' hashes to `chain`; returns their keys."""
        step, table, keys = self._segment_key_bytes, self._table, []
        with self._lock:
            for s in range(num_segments):
                key = (parent, raw[s * step : (s + 1) * step])
                hit = table.get(key)
                if hit is None:
                    break
                keys.append(key)
                chain += hit
                parent = hit[-1]
        return keys

    def _insert(self, entries: list[tuple[tuple, list[bytes]]], hit_keys: list[tuple]) -> None:
        """Stores a prompt's new segments and refreshes its hit ones, deepest first, so that
        a chain's first segment is its most recently used: a later prompt reaches segment s
        only through segments 0..s-1, so LRU must evict a chain from its end."""
        if self.max_entries == 0:
            return
        entries = entries[: self.max_entries]  # one huge prompt keeps its leading segments
        with self._lock:
            table = self._table
            for key, hashes in reversed(entries):
                table[key] = hashes
            for key in reversed(hit_keys):
                if key in table:  # another thread may have evicted it since the walk
                    table.move_to_end(key)
            while len(table) > self.max_entries:
                table.popitem(last=False)
                self.stats.evictions += 1


def _entry_bytes(key_bytes: int, segment_blocks: int) -> int:
    """Bytes one table entry holds: the key tuple, its token bytes, the parent hash, the list
    of hashes and the hash objects, plus the OrderedDict's slot and link node."""
    digest = sys.getsizeof(bytes(DIGEST_SIZE))
    key = sys.getsizeof((b"", b"")) + sys.getsizeof(bytes(key_bytes)) + digest
    value = sys.getsizeof([None] * segment_blocks) + segment_blocks * digest
    return key + value + 128
