"""Registrations, cached blocks and pending probes, and their match: the in-process index
(`InMemoryPrefixIndex`) keeps its state in one, and a router's mirror of the Redis index
(cluster/index/mirror.py) keeps its copy current from the index's log.

A match must cost little at any group count, so the copy is also kept inverted: besides each
registration's own inventory and pending probes (needed to drop them when it goes), every cached
block maps to a bitmask of the registrations holding it, and every pending probe to a bitmask of
those with an entry for it. A match walks the chain's probes once for all groups (a running AND
of their masks, one binary search for all the groups that answer alike) and touches a group only
where the chain is cached or pending on it; every other live group gets its prebuilt empty
answer (benchmarks/RESULTS.md: the match against a loop over the groups).

It answers what `RedisPrefixIndex.match` answers: leading cached blocks counted at the chain's
probe positions, then between the last probe held and the first missed (exact while holdings are
prefix-closed, which the block manager keeps), and leading pending blocks at probe granularity
(deadlines never grow along a chain, so the unexpired probes are a prefix). A pending probe
leaves its masks when its deadline passes: every entry's deadline also goes on a heap, popped
before each match, so a match never reads a deadline.

Each registration's tiers under the pool (host, disk) are kept beside its device inventory, each
with masks of its own; a match that finds a chain's head in a lower tier counts, the same way,
the leading blocks held on the device or the host, and those held in any tier: the blocks past
the device's lead restored from the host, then those fetched from the disk. Without lower
tiers in the copy, a match costs what it cost before them.
Liveness is on the caller's clock: a registration lives until `ttl_s` after its last `touch`;
the clock passed to the calls must not go back. Not thread-safe: its owners hold their lock
around every call.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from cluster.index.probes import prefix_length, probe_hashes, probe_positions
from cluster.index.types import GroupMatch, Matches, TierInventory
from worker.kv_events import DEVICE, DISK, HOST


@dataclass
class CopiedGroup:
    """One live registration as the copy knows it."""

    epoch: int
    bit: int  # 1 << slot: the registration's bit in the copy's masks
    deadline: float  # the caller's clock
    # the cached block hashes, as a dict's keys: a dict of bytes is never tracked by the garbage
    # collector (a set is, and a full collection over 64 groups' sets stalls the router)
    inventory: dict[bytes, None] = field(default_factory=dict)
    pending: dict[bytes, float] = field(default_factory=dict)  # probe hash -> deadline
    nothing: GroupMatch | None = None  # the group's match of nothing
    host: dict[bytes, None] = field(default_factory=dict)  # the host tier's hashes
    disk: dict[bytes, None] = field(default_factory=dict)  # the disk tier's hashes

    def tier(self, medium: str) -> dict[bytes, None]:
        """The hashes of one medium's inventory."""
        return self.inventory if medium == DEVICE else self.host if medium == HOST else self.disk

    def tiers(self) -> TierInventory:
        """Every medium's hashes."""
        return {DEVICE: frozenset(self.inventory), HOST: frozenset(self.host), DISK: frozenset(self.disk)}

    def empty_match(self, group_id: str) -> GroupMatch:
        if self.nothing is None:
            self.nothing = GroupMatch(group_id, self.epoch, 0, 0)
        return self.nothing


class IndexCopy:
    """Registrations, their cached blocks and pending probes; see the module docstring."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self.groups: dict[str, CopiedGroup] = {}
        self._by_bit: dict[int, tuple[str, CopiedGroup]] = {}
        self._free_bits: list[int] = []  # bits of dropped registrations, reused first
        self._next_bit = 1
        self._held: dict[bytes, int] = {}  # block hash -> registrations holding it
        self._pending: dict[bytes, int] = {}  # probe hash -> registrations with an entry
        self._host: dict[bytes, int] = {}  # block hash -> registrations whose host tier holds it
        self._disk: dict[bytes, int] = {}  # block hash -> registrations whose disk tier holds it
        # (deadline, seq, registration, probes given that deadline): popped when it passes
        self._expiry: list[tuple[float, int, CopiedGroup, list[bytes]]] = []
        self._seq = itertools.count()
        # The live set as of the last count; it holds until _live_until (the earliest deadline
        # in it) unless a registration comes, goes or revives, which resets _live_until.
        self._live = 0
        self._live_until = float("-inf")
        self._empty: dict[str, GroupMatch] = {}  # every live group's empty answer
        # bit -> the last answer built for that registration: a hot document's chain gets the
        # same counts from most of its groups match after match
        self._answers: dict[int, GroupMatch] = {}

    def sizes(self) -> tuple[int, int]:
        """(distinct cached blocks, distinct pending probes) the copy holds masks for."""
        return len(self._held), len(self._pending)

    def live_inventory(self, now: float) -> tuple[int, int, int]:
        """(entries, distinct blocks, groups) of the live registrations' device tiers, without
        a pass over the blocks: the distinct count is of every registration not yet dropped."""
        live = [g for g in self.groups.values() if g.deadline > now]
        return sum(len(g.inventory) for g in live), len(self._held), len(live)

    def lower_entries(self, now: float) -> int:
        """(group, block) pairs of the live registrations' host and disk tiers."""
        return sum(len(g.host) + len(g.disk) for g in self.groups.values() if g.deadline > now)

    # ---- registrations ----------------------------------------------------------------
    def register(self, group_id: str, epoch: int, now: float, ttl_s: float | None = None) -> CopiedGroup:
        """A new registration (a restart's new epoch replaces the old one and its entries), live
        for `ttl_s` (default the copy's TTL; a snapshot gives what the registration has left)."""
        if group_id in self.groups:
            self.drop(group_id)
        if self._free_bits:
            bit = self._free_bits.pop()
        else:
            bit, self._next_bit = self._next_bit, self._next_bit << 1
        g = CopiedGroup(epoch, bit, now + (self.ttl_s if ttl_s is None else ttl_s))
        self.groups[group_id] = g
        self._by_bit[bit] = (group_id, g)
        self._answers.pop(bit, None)
        self._live_until = float("-inf")
        return g

    def drop(self, group_id: str) -> None:
        """Forget a registration and everything it held."""
        g = self.groups.pop(group_id)
        _unset(self._held, g.inventory, g.bit)
        _unset(self._host, g.host, g.bit)
        _unset(self._disk, g.disk, g.bit)
        _unset(self._pending, g.pending, g.bit)
        del self._by_bit[g.bit]
        self._free_bits.append(g.bit)
        self._live_until = float("-inf")

    def touch(self, g: CopiedGroup, now: float) -> None:
        """An entry of the registration arrived: it lives `ttl_s` from now."""
        g.deadline = now + self.ttl_s
        if not self._live & g.bit:
            self._live_until = float("-inf")  # counted dead before: count again

    # ---- cached blocks ------------------------------------------------------------------
    def _masks(self, medium: str) -> dict[bytes, int]:
        return self._held if medium == DEVICE else self._host if medium == HOST else self._disk

    def store(self, g: CopiedGroup, hashes: Sequence[bytes], medium: str = DEVICE) -> None:
        """`hashes` entered the registration's tier `medium`."""
        inventory = g.tier(medium)
        new = [h for h in hashes if h not in inventory]
        inventory.update(dict.fromkeys(new))
        masks = self._masks(medium)
        get, bit = masks.get, g.bit
        for h in new:
            masks[h] = get(h, 0) | bit

    def remove(self, g: CopiedGroup, hashes: Sequence[bytes], medium: str = DEVICE) -> None:
        """`hashes` left the registration's tier `medium`."""
        inventory = g.tier(medium)
        gone = [h for h in hashes if h in inventory]
        for h in gone:
            del inventory[h]
        _unset(self._masks(medium), gone, g.bit)

    def clear(self, g: CopiedGroup) -> None:
        """Every tier of the registration emptied."""
        _unset(self._held, g.inventory, g.bit)
        _unset(self._host, g.host, g.bit)
        _unset(self._disk, g.disk, g.bit)
        g.inventory, g.host, g.disk = {}, {}, {}

    # ---- pending probes -----------------------------------------------------------------
    def add_pending(self, g: CopiedGroup, probes: Sequence[bytes], deadline: float, now: float) -> None:
        """Raise the probes' deadlines to `deadline` (an entry never shortens)."""
        self._expire(now)
        if deadline <= now:
            return
        pending, marks, get, bit = g.pending, self._pending, self._pending.get, g.bit
        raised = []
        for h in probes:
            if pending.get(h, 0.0) < deadline:
                if h not in pending:
                    marks[h] = get(h, 0) | bit
                pending[h] = deadline
                raised.append(h)
        if raised:
            heapq.heappush(self._expiry, (deadline, next(self._seq), g, raised))

    def place(self, g: CopiedGroup, probed: Sequence[bytes], fresh: int, ttl_s: float, now: float) -> None:
        """The pending script's rule for one placement: probes after the `fresh` leading ones
        get now + ttl, capped at the deadline of the last fresh probe while it is pending
        (deadlines never grow along a chain)."""
        deadline = now + ttl_s
        if fresh > 0:
            d = g.pending.get(probed[fresh - 1], 0.0)
            if d > now:
                deadline = min(deadline, d)
            else:
                fresh = 0
        self.add_pending(g, probed[fresh:], deadline, now)

    def fresh(self, g: CopiedGroup, probed: Sequence[bytes], after: float) -> int:
        """How many leading `probed` are pending on `g` past `after`, by binary search
        (deadlines never grow along a chain, so they are a prefix)."""
        pending = g.pending
        return prefix_length(len(probed), lambda i: pending.get(probed[i], 0.0) > after)

    def _expire(self, now: float) -> None:
        """Drop the pending probes whose deadline passed (those raised since stay)."""
        heap, marks = self._expiry, self._pending
        while heap and heap[0][0] <= now:
            deadline, _, g, probes = heapq.heappop(heap)
            if self._by_bit.get(g.bit, (None, None))[1] is not g:
                continue  # dropped: its entries went with it
            pending, bit = g.pending, g.bit
            for h in probes:
                if pending.get(h) == deadline:
                    del pending[h]
                    m = marks[h] & ~bit
                    if m:
                        marks[h] = m
                    else:
                        del marks[h]

    # ---- the match ----------------------------------------------------------------------
    def match(self, block_hashes: Sequence[bytes], now: float) -> Matches:
        """Every live registration's match of the chain; see the module docstring."""
        if now >= self._live_until:
            self._count_live(now)
        if self._expiry and self._expiry[0][0] <= now:
            self._expire(now)
        out = Matches(self._empty)
        if not block_hashes:
            return out
        h0, live = block_hashes[0], self._live
        held = self._held.get(h0, 0) & live
        pend = self._pending.get(h0, 0) & live
        lower_tiers = bool(self._host or self._disk)
        lower = (self._host.get(h0, 0) | self._disk.get(h0, 0)) & live if lower_tiers else 0
        if not held | pend | lower:
            return out  # the usual case for a new prompt: no group touched at all
        pos, probed = probe_positions(len(block_hashes)), probe_hashes(block_hashes)
        cached = self._cached(block_hashes, pos, probed, held, self._held.get) if held else {}
        tiers = self._tiers(block_hashes, pos, probed, held | lower, cached) if lower_tiers and held | lower else {}
        pop, below, touched = cached.pop, tiers.pop, out.touched
        if pend:  # leading pending blocks, at probe granularity
            for k, groups in _leading(pend, probed, self._pending.get):
                p = pos[k - 1] + 1 if k else 0
                while groups:
                    bit = groups & -groups
                    groups ^= bit
                    a = self._answer(bit, pop(bit, 0), p, *below(bit, _NONE_BELOW))
                    out[a[0]] = a
                    touched.append(a[0])
        for bit, c in cached.items():
            a = self._answer(bit, c, 0, *below(bit, _NONE_BELOW))
            out[a[0]] = a
            touched.append(a[0])
        for bit, (host, disk) in tiers.items():  # held only under the device
            a = self._answer(bit, 0, 0, host, disk)
            out[a[0]] = a
            touched.append(a[0])
        return out

    def _answer(self, bit: int, blocks: int, pending: int, host: int = 0, disk: int = 0) -> GroupMatch:
        """The registration's answer with these counts: the last one built, if it had them."""
        a = self._answers.get(bit)
        if a is None or a[2] != blocks or a[3] != pending or a[4] != host or a[5] != disk:
            gid, g = self._by_bit[bit]
            a = self._answers[bit] = _new_answer(GroupMatch, (gid, g.epoch, blocks, pending, host, disk))
        return a

    def _tiers(self, chain, pos, probed, groups: int, cached: dict[int, int]) -> dict[int, tuple[int, int]]:
        """bit -> (host blocks, disk blocks) after each registration's device lead (`cached`),
        for those of `groups` whose chain goes on below the device: the lead held on the device
        or the host, then the lead held in any tier, counted as the device's is."""
        dev, host, disk = self._held.get, self._host.get, self._disk.get

        def upper(h: bytes, default: int) -> int:
            return dev(h, 0) | host(h, 0)

        def every(h: bytes, default: int) -> int:
            return dev(h, 0) | host(h, 0) | disk(h, 0)

        up_groups = groups & upper(chain[0], 0)
        up = self._cached(chain, pos, probed, up_groups, upper) if up_groups else {}
        out = {}
        for bit, a in self._cached(chain, pos, probed, groups, every).items():
            d = cached.get(bit, 0)
            u = max(up.get(bit, 0), d)
            if a > d:
                out[bit] = (u - d, max(a, u) - u)
        return out

    def _cached(self, chain, pos, probed, held: int, get: Callable[[bytes, int], int]) -> dict[int, int]:
        """bit -> leading blocks of the registrations in `held` whose masks `get` answers."""
        n, out = len(chain), {}
        for k, groups in _leading(held, probed, get):
            if k == len(pos):
                out.update(dict.fromkeys(_bits(groups), n))
                continue
            lo = pos[k - 1] + 1 if k else 0  # the gap between the last probe held and the next
            for j, gap_groups in _leading(groups, chain, get, lo, pos[k]):
                out.update(dict.fromkeys(_bits(gap_groups), j))
        return out

    def _count_live(self, now: float) -> None:
        live, until, empty = 0, float("inf"), {}
        for gid, g in self.groups.items():
            if g.deadline > now:
                live |= g.bit
                until = min(until, g.deadline)
                empty[gid] = g.empty_match(gid)
        self._live, self._live_until, self._empty = live, until, empty


def _leading(
    mask: int,
    hashes: Sequence[bytes],
    get: Callable[[bytes, int], int],
    start: int = 0,
    stop: int | None = None,
) -> Iterator[tuple[int, int]]:
    """(k, groups) pairs: the registrations of `mask` whose bit is set in `get(h, 0)` for the
    `hashes` before index k from `start` on (up to `stop`) and not at k. Every group's holdings
    are a prefix (a chain hash covers every block before it, and holdings stay prefix-closed),
    so one binary search serves all the groups that answer alike: ~7 lookups for a 95-probe
    chain instead of 95. No slice is taken: a chain's hash is sliced out only when read."""
    # (groups, lo, hi): each of the groups holds at least lo of the hashes, at most hi
    todo = [(mask, start, len(hashes) if stop is None else stop)]
    while todo:
        groups, lo, hi = todo.pop()
        while lo < hi:
            mid = (lo + hi + 1) // 2
            has = groups & get(hashes[mid - 1], 0)
            if has != groups and has:
                todo.append((groups & ~has, lo, mid - 1))  # these stop before mid
            if has:
                groups, lo = has, mid
            else:
                hi = mid - 1
        yield lo, groups


_NONE_BELOW = (0, 0)  # no blocks under the device: (host, disk)

# A match builds an answer per group it touches: tuple.__new__ skips the named tuple's
# Python-level __new__, half the cost.
_new_answer = tuple.__new__


def _bits(mask: int) -> Iterator[int]:
    while mask:
        low = mask & -mask
        yield low
        mask ^= low


def _unset(table: dict[bytes, int], hashes, bit: int) -> None:
    """Clear `bit` in the masks of `hashes`, dropping masks left empty."""
    for h in hashes:
        m = table.get(h, 0) & ~bit
        if m:
            table[h] = m
        else:
            table.pop(h, None)
