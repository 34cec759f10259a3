"""The KV block manager of one group: ref counts, prefix cache, LRU eviction, KV events.

Pure Python, no torch: it hands out block ids; the KV pool on each device owns the bytes.
Built from predicate/action pairs that the scheduler calls in order:
    match_prefix -> can_allocate -> allocate      (admit, given the cached prefix)
    can_append -> append_slots                    (grow a running request)
    free                                          (finish, abort or preempt)

With a host tier (`host`, a TierIndex) under the pool, a cached block the pool evicts is
written back to the host (a save), unless the host holds it already; a prefix lookup follows
the hash chain block by block on the device, else on the host, and a host hit is restored
into a fresh device block (a load), which is then an ordinary cached block: a second request
finds it on the device and nothing is loaded twice. Saves and loads accumulate in `moves`,
which the scheduler hands to every rank with the step (worker/step.py `KVMoves`).

With a disk tier (`disk`) under the host, a block the host evicts is demoted to it, and a
lookup goes on from the host to the disk: disk hits are fetched into host slots, then loaded
as host hits; a block that any rank fails to read whole ends the match there, a miss (the
request recomputes it and the rest of its chain).

With a `loader` (the executor's `fetch_start`, `fetch_ready`, `fetch_wait`) the reads run off
the step's path: `match_prefix` starts a load of the chain's disk blocks into host slots held
across steps (`TierIndex.hold`), records each hash in `loading`, and returns a match that
`waits` on them; the scheduler keeps that request in its loading state (not scheduled, other
requests stepped on). A second request whose chain meets a hash in `loading` waits on the same
load: each block is read once. `poll_loads` (each step, before the scheduler admits anyone)
asks the executor which loads rank 0 has read, then has every rank wait for and agree on those
(the smallest count each read whole over the ranks): only then are the blocks host blocks
that a match may restore. The decision to start a load and the one to complete it are rank
0's and reach the other ranks in order with the steps (worker/exec/tp_executor.py), so every
rank's host slots hold the same blocks when a step's loads read them. Without a loader the
reads are made between two steps (`fetch`), the request admitted after them.

At a clean shutdown, `flush_moves` writes down to the disk what a restart would otherwise
lose: the host's blocks the disk lacks, then the device's cached full blocks (through host
slots, the only path from the device to the disk), in batches of moves that every rank makes.

Pins (`pin`, `unpin`) hold cached blocks by hash for a document the group keeps warm: each pin
is a reference like a request's, so a pinned block never reaches the free queue, and so is
neither evicted nor written down to a lower tier; several pins of one block (two documents that
share a prefix) count each. `pinned` holds each pinned hash's count.

KV quotas (`quotas`, tenant -> blocks): each cached block belongs to the tenant whose request
took it from the free queue (the first to commit its hash), and a tenant's unreferenced cached
blocks count against its quota. An eviction takes an uncached free block first, else the least
recently used block of the tenant furthest over its quota (a tenant not named has a quota of 0;
when none is over, the one least under it): so a tenant under its quota keeps its blocks against
another's flood, whose own blocks are evicted instead, and loses them only when no other tenant
has an unreferenced block left (running requests need the pool). Per-tenant LRU lists make each eviction
O(tenants with idle blocks); with no quotas (None) eviction is the global LRU, unchanged.
`evictions_caused` and `evictions_suffered` count, per tenant, the cached blocks its requests
evicted and the ones of its that were evicted (with quotas only).

Write-back rather than write-through: a save costs a copy only for a block the pool is about
to lose, which under no memory pressure is never, and the host holds what the device does not
(a write-through host mirrors the device, so its first pool's worth of blocks adds nothing).
The price is the copy of an evicted block before the forward that reuses it; its figures are
in benchmarks/RESULTS.md (KV tiers).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from worker.engine.block_pool import Block, FreeBlockQueue
from worker.engine.request import Request
from worker.engine.tier_index import TierIndex
from worker.hashing import BlockHasher
from worker.kv_events import (
    DEVICE,
    DISK,
    HOST,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventSink,
    discard_events,
)
from worker.outputs import CachedTiers
from worker.step import KVMoves

# (disk writes to make first, [(hash, host slot)] to read from the disk) -> how many were read
Fetch = Callable[[KVMoves, list[tuple[bytes, int]]], int]


class Loader(Protocol):
    """Disk reads off the step's path, on every rank (worker/exec/executor.py `Executor`)."""

    def fetch_start(self, early: KVMoves, fetches: list[tuple[bytes, int]]) -> None: ...

    def fetch_ready(self) -> int: ...

    def fetch_wait(self, n: int) -> list[int]: ...


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class PrefixMatch:
    """The leading cached blocks a request can reuse: `blocks` on the device, and `loads`,
    the chain's positions found on the host tier instead, each (position, hash, host slot)."""

    blocks: tuple[Block, ...]
    block_size: int
    loads: tuple[tuple[int, bytes, int], ...] = ()
    # hashes of the chain a load from the disk is reading: the request waits for them (and
    # is matched again when they are read); empty: the match can be allocated now
    waits: frozenset[bytes] = frozenset()

    @property
    def num_tokens(self) -> int:
        return (len(self.blocks) + len(self.loads)) * self.block_size


class BlockManager:
    """Hands out the group's block ids and keeps full blocks reusable by hash."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        hasher: BlockHasher | None = None,
        event_sink: KVEventSink = discard_events,
        host: TierIndex | None = None,
        disk: TierIndex | None = None,
        fetch: Fetch | None = None,
        quotas: Mapping[str, int] | None = None,
        loader: Loader | None = None,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if hasher is not None and hasher.block_size != block_size:
            raise ValueError("the hasher's block size differs from the pool's")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.hasher = hasher  # None: prefix caching disabled
        self.emit = event_sink
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, Block] = {}  # prefix cache: block hash -> the block holding it
        self.req_blocks: dict[str, list[Block]] = {}
        # the same tables as ids, kept in step (read through `block_ids` or `table_of`)
        self._req_block_ids: dict[str, list[int]] = {}
        # a running request's block table, or None: `block_ids` for the scheduler's every step
        self.table_of = self._req_block_ids.get
        self._num_committed: dict[str, int] = {}  # leading blocks of a request already offered to the cache
        self.prefix_queries = 0  # tokens looked up at admission
        self.prefix_hits = 0  # of which served from the cache (any tier)
        self.host = host if hasher is not None else None  # the host tier's slots, or None
        self.disk = disk if self.host is not None else None  # the disk tier's, under the host
        self.fetch = fetch  # reads disk blocks into host slots on every rank (needed with `disk`)
        assert self.disk is None or fetch is not None, "a disk tier needs a fetch"
        self.disk_hits = 0  # tokens of prefix hits fetched from the disk tier
        self.disk_failures = 0  # blocks the disk tier could not read whole (misses)
        self.loader = loader if self.disk is not None else None  # reads off the step's path
        self.loading: dict[bytes, int] = {}  # hash -> host slot, of the loads in flight
        self._loads: deque[list[tuple[bytes, int]]] = deque()  # the loads in flight, oldest first
        self.moves = KVMoves()  # this step's copies between tiers, so far
        self.host_hits = 0  # tokens of prefix hits restored from the host tier
        self.host_saves = 0  # blocks written back to the host tier
        self.pinned: dict[bytes, int] = {}  # block hash -> pins holding it (see `pin`)
        self.blocks_imported = 0  # blocks pulled from another group into the host tier
        # host blocks that came from the disk ("disk") or another group ("pull") and are not
        # restored yet: a request restoring one reports its tokens under that tier (`tiers_of`)
        self.arrived: dict[bytes, str] = {}
        # tenant -> its KV quota in device blocks (see the module docstring); None: global LRU
        self.quotas = dict(quotas) if quotas is not None and hasher is not None else None
        # tenant -> its unreferenced cached blocks by id, least recently used first (quotas only)
        self._idle: dict[str, OrderedDict[int, Block]] = {}
        self.evictions_caused: dict[str, int] = {}  # tenant -> cached blocks its requests evicted
        self.evictions_suffered: dict[str, int] = {}  # tenant -> its cached blocks evicted

    # ---- state -------------------------------------------------------------------------
    @property
    def enable_prefix_caching(self) -> bool:
        return self.hasher is not None

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no reference: empty ones and cached ones that may be evicted."""
        return len(self.free_queue)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table (a live list: it grows with the request)."""
        return self._req_block_ids.get(request_id, [])

    def cached_hashes(self) -> Iterator[bytes]:
        """Every hash in the prefix cache on the device."""
        return iter(list(self.cached))

    def tier_hashes(self) -> dict[str, list[bytes]]:
        """Every hash of every tier, by medium: the inventory a publisher republishes."""
        out = {DEVICE: list(self.cached)}
        for tier in (self.host, self.disk):
            if tier is not None:
                out[tier.medium] = list(tier.hashes())
        return out

    # ---- admit -------------------------------------------------------------------------
    def match_prefix(self, request: Request) -> PrefixMatch:
        """Leading cached blocks of `request`; never the block holding its last token,
        whose logits must be computed."""
        if self.hasher is None:
            return PrefixMatch((), self.block_size)
        self._hash_known_blocks(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks = []
        cached, host = self.cached, self.host
        for i, h in enumerate(request.block_hashes[:max_blocks]):
            block = cached.get(h)
            if block is None:
                if host is not None and (h in host or (self.disk is not None and h in self.disk)):
                    return self._match_below(request, blocks, i, max_blocks)
                break
            blocks.append(block)
        return PrefixMatch(tuple(blocks), self.block_size)

    def _match_below(self, request: Request, blocks: list[Block], i: int, max_blocks: int) -> PrefixMatch:
        """The chain from position `i` on, each block on the device, else on the host, else
        on the disk (fetched to the host now)."""
        cached, host, disk = self.cached, self.host, self.disk
        loads, fetches = [], []
        loading, waits = self.loading, []
        for pos in range(i, max_blocks):
            h = request.block_hashes[pos]
            block = cached.get(h)
            if block is not None:
                blocks.append(block)
            elif h in loading:  # (a load in flight fills its host slot: not yet a host block)
                waits.append((pos, h))
            elif (slot := host.get(h)) is not None:
                host.pin(slot)  # (a fetch below must not take it)
                loads.append((pos, h, slot))
            elif disk is not None and h in disk:
                fetches.append((pos, h))
            else:
                break
        if self.loader is not None and (fetches or waits):
            started = self._start_load(fetches, request.tenant)
            if waits or started:
                return PrefixMatch((), self.block_size, (), frozenset(h for _, h in waits + fetches[:started]))
            end = fetches[0][0]  # no host slot for a load this step: the match ends there
            blocks = blocks[: end - len([p for p, *_ in loads if p < end])]
            return PrefixMatch(tuple(blocks), self.block_size, tuple(x for x in loads if x[0] < end))
        if fetches:
            got = self._fetch(fetches, request.tenant)
            if got < len(fetches):  # the chain ends at the first block not read whole
                end = fetches[got][0]
                blocks = blocks[: end - len([p for p, *_ in loads if p < end]) - got]
                loads = [x for x in loads if x[0] < end]
            loads = sorted(loads + [(pos, h, host.get(h)) for pos, h in fetches[:got]])
        return PrefixMatch(tuple(blocks), self.block_size, tuple(loads))

    def _fetch(self, fetches: list[tuple[int, bytes]], tenant: str = "") -> int:
        """Read disk blocks (position, hash) into host slots (`tenant`'s); returns how many of
        them, in order, every rank read whole. The ones after are forgotten (misses)."""
        host, disk = self.host, self.disk
        slots, victims = [], []
        for _, h in fetches:
            put = host.put(h, disk.owner(h) or tenant)
            if put is None:  # the host's slots are all in use this step: fetch fewer
                break
            slot, victim = put
            if victim is not None:
                victims.append(victim)
                self._demote(victim, slot, host.victim_tenant)
            slots.append((h, slot))
        if victims:
            self.emit(BlockRemoved(tuple(victims), HOST))
        # the step's disk writes so far are made first, by the fetch (they read host slots
        # that no copy of this step has written yet)
        early = KVMoves(demotes=self.moves.demotes, drops=self.moves.drops)
        self.moves.demotes, self.moves.drops = [], []
        got = self.fetch(early, slots)
        for h, _ in slots[got:]:
            host.drop(h)
        failed = [h for _, h in fetches[got : len(slots)]]
        self.disk_failures += 1 if failed else 0  # (the rest are only unreachable after it)
        for h in failed:
            disk.drop(h)
        if failed:
            self.emit(BlockRemoved(tuple(failed), DISK))
        if got:
            self.emit(BlockStored(tuple(h for h, _ in slots[:got]), None, HOST))
            self._arrive((h for h, _ in slots[:got]), "disk")
        self.disk_hits += got * self.block_size
        return got

    def _start_load(self, fetches: list[tuple[int, bytes]], tenant: str = "") -> int:
        """Start reading disk blocks (position, hash) into host slots (`tenant`'s), held until
        the read is done on every rank; returns how many (the leading ones the host has slots
        for)."""
        host, slots, victims = self.host, [], []
        for _, h in fetches:
            put = host.put(h, self.disk.owner(h) or tenant)
            if put is None:
                break
            slot, victim = put
            host.hold(slot)
            if victim is not None:
                victims.append(victim)
                self._demote(victim, slot, host.victim_tenant)
            slots.append((h, slot))
            self.loading[h] = slot
        if victims:
            self.emit(BlockRemoved(tuple(victims), HOST))
        if slots:
            early = KVMoves(demotes=self.moves.demotes, drops=self.moves.drops)
            self.moves.demotes, self.moves.drops = [], []
            self.loader.fetch_start(early, slots)
            self._loads.append(slots)
        return len(slots)

    @property
    def loads_in_flight(self) -> int:
        """Loads from the disk started and not yet completed."""
        return len(self._loads)

    def poll_loads(self, block: bool = False) -> list[bytes]:
        """Complete the loads rank 0 has read (with `block`, at least the oldest, waited
        for): every rank agrees on each one's count read whole, the blocks read are host
        blocks from now on (kept for this step), the rest misses (forgotten by the host and the
        disk). Returns the hashes no longer loading."""
        if not self._loads:
            return []
        ready = self.loader.fetch_ready()
        if not ready and block:
            ready = 1
        if not ready:
            return []
        host, disk, done = self.host, self.disk, []
        for got in self.loader.fetch_wait(ready):
            slots = self._loads.popleft()
            for h, slot in slots:
                host.release(slot)
                del self.loading[h]
                done.append(h)
            for _, slot in slots[:got]:
                host.pin(slot)  # (this step's admissions restore them before anything evicts them)
            failed = [h for h, _ in slots[got:]]
            for h in failed:
                host.drop(h)
                disk.drop(h)
            if failed:
                self.disk_failures += 1
                self.emit(BlockRemoved(tuple(failed), DISK))
            if got:
                self.emit(BlockStored(tuple(h for h, _ in slots[:got]), None, HOST))
                self._arrive((h for h, _ in slots[:got]), "disk")
            self.disk_hits += got * self.block_size
        return done

    def drain_loads(self) -> None:
        """Complete every load in flight, waiting (a shutdown, before the tiers are flushed)."""
        while self._loads:
            self.poll_loads(block=True)

    def adopt_disk(self, hashes: list[bytes]) -> None:
        """The disk tier's blocks from before this start (least recently written first), in
        its index and stored on "disk" in one event, so that the prefix index learns them."""
        if self.disk is None or not hashes:
            return
        for h in hashes[-self.disk.num_slots :]:
            self.disk.put(h)
        self.disk.unpin_all()
        self.emit(BlockStored(tuple(self.disk.hashes()), None, DISK))

    def can_allocate(
        self, request: Request, match: PrefixMatch, num_new_tokens: int, reserve_blocks: int = 0, protect: bool = False
    ) -> bool:
        """Whether `request` fits with its cached prefix plus `num_new_tokens`, leaving
        `reserve_blocks` free (the admission watermark); with `protect` (and KV quotas), also
        leaving the other tenants' idle blocks within their quotas (`protected_blocks`)."""
        new = cdiv(match.num_tokens + num_new_tokens, self.block_size) - len(match.blocks)
        hits_on_free = sum(1 for b in match.blocks if b.ref_cnt == 0)
        free = self.num_free_blocks - (self.protected_blocks(request.tenant) if protect else 0)
        return new + hits_on_free + reserve_blocks <= free

    def protected_blocks(self, tenant: str) -> int:
        """The other tenants' unreferenced cached blocks within their quotas: a working set
        that admitting a request of `tenant` should not evict (0 without quotas). Evicting
        them is what a flood does while its own requests hold the rest of the pool, since the
        quotas rank only the idle blocks (see `_victim`)."""
        if self.quotas is None:
            return 0
        quotas = self.quotas
        return sum(min(len(idle), quotas.get(t, 0)) for t, idle in self._idle.items() if t != tenant)

    def allocate(self, request: Request, match: PrefixMatch, num_new_tokens: int) -> list[int]:
        """Take the cached prefix and enough new blocks for `num_new_tokens`; returns the
        request's block table."""
        rid = request.request_id
        assert rid not in self.req_blocks, f"{rid} already holds blocks"
        for block in match.blocks:
            self._touch(block)
        num_new = cdiv(match.num_tokens + num_new_tokens, self.block_size) - len(match.blocks)
        for _, _, slot in match.loads:  # (before any eviction below could reuse the slot)
            self.host.pin(slot)
        fresh = self._take_free(num_new, request.tenant)
        blocks = self._restore(match, fresh) if match.loads else list(match.blocks) + fresh
        self.req_blocks[rid] = blocks
        self._req_block_ids[rid] = [b.block_id for b in blocks]
        self._num_committed[rid] = len(match.blocks) + len(match.loads)
        if self.hasher is not None:
            self.prefix_queries += request.num_tokens
            self.prefix_hits += match.num_tokens
        self._commit_full_blocks(request, match.num_tokens + num_new_tokens)
        return self._req_block_ids[rid]

    def _restore(self, match: PrefixMatch, fresh: list[Block]) -> list[Block]:
        """The table of a match with host hits: each host hit's hash is cached in a fresh
        block at once (its load is made before the forward that reads it), device hits in
        their places, the remaining fresh blocks after them. Each run of restored blocks is
        a store on the device."""
        device, spare = iter(match.blocks), iter(fresh)
        loads = {pos: (h, slot) for pos, h, slot in match.loads}
        table: list[Block] = []
        run: list[bytes] = []  # restored hashes in a row
        for pos in range(len(match.blocks) + len(match.loads)):
            if pos not in loads:
                self._emit_run(run, table)
                table.append(next(device))
                continue
            h, slot = loads[pos]
            self.arrived.pop(h, None)  # (restored: from now on a host hit like any other)
            block = next(spare)
            block.block_hash = h
            self.cached[h] = block
            self.host.touch(h)
            self.moves.loads.append((slot, block.block_id))
            run.append(h)
            table.append(block)
        self._emit_run(run, table)
        self.host_hits += len(match.loads) * self.block_size
        return table + list(spare)

    def _emit_run(self, run: list[bytes], table: list[Block]) -> None:
        """A store of the restored hashes `run`, which end `table`; empties `run`."""
        if run:
            before = len(table) - len(run) - 1
            self.emit(BlockStored(tuple(run), table[before].block_hash if before >= 0 else None))
            run.clear()

    def take_moves(self) -> KVMoves | None:
        """This step's copies between tiers (None: none), handed to every rank with the step;
        the tiers' slots are free to reuse from the next step on."""
        if self.host is None:
            return None
        self.host.unpin_all()
        if self.disk is not None:
            self.disk.unpin_all()
        moves, self.moves = self.moves, KVMoves()
        return moves if moves else None

    # ---- grow --------------------------------------------------------------------------
    def can_append(self, request: Request, num_new_tokens: int, protect: bool = False) -> bool:
        """Whether a running request has room for `num_new_tokens` more; `protect`: as in
        `can_allocate`, leaving the other tenants' idle blocks within their quotas."""
        free = self.num_free_blocks - (self.protected_blocks(request.tenant) if protect else 0)
        return self._blocks_to_grow(request, num_new_tokens) <= free

    def append_slots(self, request: Request, num_new_tokens: int, lookahead: int = 0) -> list[int]:
        """Room for `num_new_tokens` after the computed ones (and `lookahead` more, whose
        blocks a forward running ahead will need); returns the new block ids.

        Full blocks among the tokens computed by the end of this step join the prefix cache
        now: every K/V write of a layer precedes its attention in the same forward, so another
        request may already hit them in this very step.
        """
        rid = request.request_id
        new_ids = []
        end = request.num_computed_tokens + num_new_tokens
        if num := self._blocks_to_grow(request, num_new_tokens + lookahead):
            new_blocks = self._take_free(num, request.tenant)
            self.req_blocks[rid].extend(new_blocks)
            new_ids = [b.block_id for b in new_blocks]
            self._req_block_ids[rid].extend(new_ids)
        # (most decode steps fill no block: skip the call then)
        if self.hasher is not None and min(end, request.num_tokens) // self.block_size > self._num_committed[rid]:
            self._commit_full_blocks(request, end)
        return new_ids

    # ---- release -----------------------------------------------------------------------
    def free(self, request: Request) -> None:
        """Drop the request's references, tail first, so that a chain's tail is evicted
        before its head. Cached blocks stay reusable until evicted; uncached ones are
        reused first."""
        blocks = self.req_blocks.pop(request.request_id, [])
        self._req_block_ids.pop(request.request_id, None)
        self._num_committed.pop(request.request_id, None)
        for block in reversed(blocks):
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"{block} freed twice"
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)
                    if self.quotas is not None:
                        self._idle_append(block)

    # ---- pins --------------------------------------------------------------------------
    def pin(self, hashes: Sequence[bytes], tier: str = "device") -> int:
        """Hold the leading device-cached blocks of the chain `hashes` (a reference each, so
        they are never evicted); returns how many were pinned. Release them with `unpin` of
        the same leading hashes and tier.

        `tier` "host": the leading blocks cached on the device or in the host tier are kept in
        the host tier instead (TierIndex.keep): the device evicts them as any idle block, its
        write-back puts them in the host tier, and the host never evicts them while pinned."""
        if tier == "host":
            host = self.host
            if host is None:
                raise ValueError("a pin in the host tier needs a host tier (kv_host_bytes)")
            n = 0
            for h in hashes:
                if h not in self.cached and h not in host:
                    break
                n += 1
            host.keep(hashes[:n])
            return n
        n = 0
        for h in hashes:
            block = self.cached.get(h)
            if block is None:
                break
            self._touch(block)
            self.pinned[h] = self.pinned.get(h, 0) + 1
            n += 1
        return n

    def unpin(self, hashes: Sequence[bytes], tier: str = "device") -> None:
        """Drop one pin of each hash (as `pin` returned them), tail first: an unpinned chain is
        then evicted tail before head, as a freed request's is."""
        if tier == "host":
            self.host.unkeep(hashes)
            return
        for h in reversed(hashes):
            count = self.pinned.pop(h)
            if count > 1:
                self.pinned[h] = count - 1
            block = self.cached[h]  # (held: it cannot have been evicted)
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)
                if self.quotas is not None:
                    self._idle_append(block)

    @property
    def num_pinned_blocks(self) -> int:
        return len(self.pinned)

    @property
    def num_host_pinned_blocks(self) -> int:
        """Blocks documents keep in the host tier (`pin(..., tier="host")`)."""
        return 0 if self.host is None else self.host.num_kept

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; refused (False) while any block is in use or loading."""
        if self.num_free_blocks != self.num_blocks or self._loads:
            return False
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()
        self._idle.clear()
        if self.host is not None:
            self.host.clear()
        if self.disk is not None:
            self.moves.drops += list(self.disk.hashes())
            self.disk.clear()
        self.emit(AllBlocksCleared())
        return True

    # ---- shutdown ----------------------------------------------------------------------
    def flush_moves(self, batch: int = 64) -> Iterator[KVMoves]:
        """A clean shutdown's copies down to the disk tier, in batches of at most `batch`
        blocks: first the host's blocks that the disk lacks, then the device's cached full
        blocks held by no tier below (each saved into a host slot, then written from it by the
        next batch, the slot's former block being on the disk already). Least recently used
        first, blocks in use (pinned or running) last, so that when the disk is the smaller
        what it keeps is the most recent (as a restart adopts the newest files). Every rank
        makes each batch in order (KVMoves' order: disk writes before host saves); a caller may
        stop between two batches (a time bound): what was written stays whole. Empty without
        a disk tier."""
        host, disk = self.host, self.disk
        if disk is None:
            return
        n = max(1, min(batch, host.num_slots, disk.num_slots))
        pending = [(host.get(h), h) for h in host.hashes() if h not in disk]  # (slot, hash)
        while pending:
            moves = KVMoves()
            for slot, h in pending[:n]:
                self._flush_demote(moves, slot, h)
            pending = pending[n:]
            yield moves
            host.unpin_all()
            disk.unpin_all()
        idle = [b for b in self.free_queue if b.block_hash is not None]
        held = [b for b in self.cached.values() if b.ref_cnt > 0]
        device = [b for b in idle + held if b.block_hash not in host and b.block_hash not in disk]
        for at in range(0, len(device) + n, n):
            moves = KVMoves()
            for slot, h in pending:  # the previous batch's saves, down to the disk first
                self._flush_demote(moves, slot, h)
            pending, stored, dropped = [], [], []
            for block in device[at : at + n]:
                put = host.put(block.block_hash, block.tenant)
                if put is None:
                    break
                slot, victim = put
                if victim is not None:  # (on the disk already, or written in this batch)
                    dropped.append(victim)
                moves.saves.append((block.block_id, slot))
                pending.append((slot, block.block_hash))
                stored.append(block.block_hash)
            if dropped:
                self.emit(BlockRemoved(tuple(dropped), HOST))
            if stored:
                self.emit(BlockStored(tuple(stored), None, HOST))
            if not moves:
                return
            yield moves
            host.unpin_all()
            disk.unpin_all()

    def _flush_demote(self, moves: KVMoves, slot: int, block_hash: bytes) -> None:
        """`block_hash`, in host `slot`, to be written to the disk by `moves` (its victim dropped)."""
        put = self.disk.put(block_hash, self.host.owner(block_hash))
        if put is None:
            return
        if put[1] is not None:
            moves.drops.append(put[1])
            self.emit(BlockRemoved((put[1],), DISK))
        moves.demotes.append((slot, block_hash))
        self.emit(BlockStored((block_hash,), None, DISK))

    # ---- blocks moved between groups (worker/kv_transfer.py) ----------------------------
    def held_chain(self, block_hashes: Sequence[bytes]) -> list[tuple[bool, int]]:
        """The leading blocks of a chain held here, each (on the device, its block id) or
        (on the host, its slot), up to the first held nowhere: what another group may pull."""
        held = []
        for h in block_hashes:
            block = self.cached.get(h)
            if block is not None:
                held.append((True, block.block_id))
            elif self.host is not None and h not in self.loading and (slot := self.host.get(h)) is not None:
                held.append((False, slot))
            else:
                break
        return held

    def host_slots_for(
        self, block_hashes: Sequence[bytes], tenant: str = ""
    ) -> tuple[list[tuple[int, bytes, int]], KVMoves]:
        """Host slots (`tenant`'s) for a pulled chain's blocks that this group holds nowhere,
        each (its position in the chain, hash, slot), stopping where the host has no slot free
        this step; and the disk writes of the slots' victims, to make before the slots are
        written."""
        if self.host is None:
            return [], KVMoves()
        host, rows, victims = self.host, [], []
        for i, h in enumerate(block_hashes):
            if h in self.cached or h in host:
                continue
            put = host.put(h, tenant)
            if put is None:
                break
            slot, victim = put
            if victim is not None:
                victims.append(victim)
                if self.disk is not None:
                    self._demote(victim, slot, host.victim_tenant)
            rows.append((i, h, slot))
        if victims:
            self.emit(BlockRemoved(tuple(victims), HOST))
        early = KVMoves(demotes=self.moves.demotes, drops=self.moves.drops)
        self.moves.demotes, self.moves.drops = [], []
        return rows, early

    def imported(self, rows: list[tuple[int, bytes, int]], ok: bool) -> None:
        """The pulled rows were written into their host slots (a store on the host), or not
        (`ok` False: the slots are free again)."""
        hashes = tuple(h for _, h, _ in rows)
        if not ok:
            for h in hashes:
                self.host.drop(h)
            return
        self.blocks_imported += len(hashes)
        if hashes:
            self.emit(BlockStored(hashes, None, HOST))
            self._arrive(hashes, "pull")

    def tiers_of(self, match: PrefixMatch) -> CachedTiers:
        """A match's tokens by the tier they come from (read before `allocate` restores it):
        the device's blocks, and each host load as a host hit unless it arrived from the disk
        or another group and was not restored since."""
        counts = {"host": 0, "disk": 0, "pull": 0}
        for _, h, _ in match.loads:
            counts[self.arrived.get(h, "host")] += self.block_size
        return CachedTiers(len(match.blocks) * self.block_size, counts["host"], counts["disk"], counts["pull"])

    def _arrive(self, hashes: Iterable[bytes], tier: str) -> None:
        """Note host blocks that came from `tier`; forget the notes of blocks the host no
        longer holds once there are more notes than host slots (so they stay bounded)."""
        arrived = self.arrived
        for h in hashes:
            arrived[h] = tier
        if len(arrived) > self.host.num_slots:
            self.arrived = {h: t for h, t in arrived.items() if h in self.host}

    # ---- internals ---------------------------------------------------------------------
    def _blocks_to_grow(self, request: Request, num_new_tokens: int) -> int:
        held = len(self.req_blocks[request.request_id])
        return max(0, cdiv(request.num_computed_tokens + num_new_tokens, self.block_size) - held)

    def _touch(self, block: Block) -> None:
        if block.ref_cnt == 0:
            self.free_queue.remove(block)
            if self.quotas is not None and block.block_hash is not None:
                del self._idle[block.tenant][block.block_id]
        block.ref_cnt += 1

    # ---- KV quotas -----------------------------------------------------------------------
    def idle_blocks(self, tenant: str) -> int:
        """`tenant`'s unreferenced cached blocks on the device: what counts against its quota."""
        idle = self._idle.get(tenant)
        return len(idle) if idle else 0

    def tenant_idle_blocks(self) -> dict[str, int]:
        """Tenant -> its unreferenced cached blocks on the device (empty without quotas)."""
        return {t: len(idle) for t, idle in self._idle.items()}

    def tenant_cached_blocks(self) -> dict[str, int]:
        """Tenant -> its cached blocks on the device, in use or not (empty without quotas)."""
        if self.quotas is None:
            return {}
        out: dict[str, int] = {}
        for block in self.cached.values():
            out[block.tenant] = out.get(block.tenant, 0) + 1
        return out

    def _idle_append(self, block: Block) -> None:
        idle = self._idle.get(block.tenant)
        if idle is None:
            idle = self._idle[block.tenant] = OrderedDict()
        idle[block.block_id] = block

    def _victim(self) -> Block:
        """The free block to reuse next, with quotas: an uncached one, else the least recently
        used of the tenant furthest over its quota (or, when none is over, the least under)."""
        head = self.free_queue.peek()
        if head is not None and head.block_hash is None:
            return self.free_queue.popleft()
        quotas, worst, over = self.quotas, None, 0
        for tenant, idle in self._idle.items():
            if idle:
                excess = len(idle) - quotas.get(tenant, 0)
                if worst is None or excess > over:
                    worst, over = idle, excess
        assert worst is not None, "a cached free block belongs to no tenant"
        block = worst.popitem(last=False)[1]
        self.free_queue.remove(block)
        return block

    def _take_free(self, n: int, tenant: str = "") -> list[Block]:
        if n > self.num_free_blocks:
            raise RuntimeError(f"asked for {n} blocks with {self.num_free_blocks} free")
        taken, evicted = [], []
        quotas = self.quotas
        for _ in range(n):
            if quotas is None:
                block = self.free_queue.popleft()
            else:
                block = self._victim()
                if block.block_hash is not None:
                    self.evictions_caused[tenant] = self.evictions_caused.get(tenant, 0) + 1
                    self.evictions_suffered[block.tenant] = self.evictions_suffered.get(block.tenant, 0) + 1
            if block.block_hash is not None:  # evict the least recently used cached block
                del self.cached[block.block_hash]
                evicted.append((block.block_id, block.block_hash, block.tenant))
                block.block_hash = None
            block.tenant = tenant
            block.ref_cnt = 1
            taken.append(block)
        if evicted:
            self.emit(BlockRemoved(tuple(h for _, h, _ in evicted)))
            if self.host is not None:
                self._save(evicted)
        return taken

    def _save(self, evicted: list[tuple[int, bytes, str]]) -> None:
        """Write evicted (block id, hash, tenant) back to the host tier, unless it holds them;
        a host block evicted for room is dropped (removed from the host)."""
        host, saves = self.host, self.moves.saves
        stored, dropped = [], []
        for block_id, h, tenant in evicted:
            if h in host:
                host.touch(h)
                continue
            put = host.put(h, tenant)
            if put is None:  # every host slot is in use this step: the block is lost
                continue
            slot, victim = put
            if victim is not None:
                dropped.append(victim)
                if self.disk is not None:
                    self._demote(victim, slot, host.victim_tenant)
            saves.append((block_id, slot))
            stored.append(h)
        self.host_saves += len(stored)
        if dropped:
            self.emit(BlockRemoved(tuple(dropped), HOST))
        if stored:
            self.emit(BlockStored(tuple(stored), None, HOST))

    def _demote(self, block_hash: bytes, slot: int, tenant: str = "") -> None:
        """The host evicts `block_hash` (`tenant`'s) from `slot`: write it to the disk tier
        (before the slot is reused), unless the disk holds it; the disk's own victim is dropped."""
        disk = self.disk
        if block_hash in disk:
            disk.touch(block_hash)
            return
        put = disk.put(block_hash, tenant)
        if put is None:
            return
        _, victim = put
        if victim is not None:
            self.moves.drops.append(victim)
            self.emit(BlockRemoved((victim,), DISK))
        self.moves.demotes.append((slot, block_hash))
        self.emit(BlockStored((block_hash,), None, DISK))

    def _hash_known_blocks(self, request: Request) -> None:
        """Extend the request's hash chain over every full block of its known tokens."""
        assert self.hasher is not None
        hashes = request.block_hashes
        if len(hashes) < request.num_tokens // self.block_size:
            parent = hashes[-1] if hashes else request.hash_root
            hashes += self.hasher.hash_blocks(request.all_token_ids, parent, len(hashes))

    def _commit_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Offer the request's full blocks among its first `num_tokens` to the prefix cache."""
        if self.hasher is None:
            return
        rid = request.request_id
        start = self._num_committed[rid]
        end = min(num_tokens, request.num_tokens) // self.block_size
        if end <= start:
            return
        self._hash_known_blocks(request)
        blocks, hashes = self.req_blocks[rid], request.block_hashes
        run_start = None  # first index of a run of newly stored blocks
        for i in range(start, end + 1):
            stored = i < end and self._store(blocks[i], hashes[i])
            if stored and run_start is None:
                run_start = i
            elif not stored and run_start is not None:
                parent = hashes[run_start - 1] if run_start > 0 else None
                self.emit(BlockStored(tuple(hashes[run_start:i]), parent))
                run_start = None
        self._num_committed[rid] = end

    def _store(self, block: Block, block_hash: bytes) -> bool:
        if block.block_hash is not None:  # a prefix hit: already cached
            return False
        if block_hash in self.cached:  # computed twice concurrently: keep the first copy
            return False
        block.block_hash = block_hash
        self.cached[block_hash] = block
        return True
