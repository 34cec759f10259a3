"""Which blocks a tier under the device pool (host memory, disk) holds: hash -> slot, LRU.

Pure Python, no torch, as the block manager it serves: it names slots; each rank's tier
(worker/exec/host_tier.py) owns the bytes. A slot that a step reads or writes is pinned until
the step is handed over (`unpin_all`), so that no later decision of the same step reuses it:
every rank then makes the step's copies in one fixed order (worker/step.py `KVMoves`). A slot
that a fetch from the disk fills off the step's path is held across steps (`hold`) until its
read is done on every rank (`release`). A hash a document pins in the tier (`keep`) is never
taken for room while kept, whether or not the tier holds it yet: the block manager writes a
device block back as it is evicted, and from then on the tier keeps it.

KV quotas (`quotas`, tenant -> slots): each block belongs to the tenant named when it was put
(the tenant whose request computed it). The slot a put takes for room is then the least
recently used unpinned one of the tenant furthest over its quota, the new block counted (a
tenant not named has a quota of 0; when none is over, the one least under it), so that a tenant under its quota
keeps its blocks in the tier against another tenant's flood, as the device pool's quotas do
(worker/engine/block_manager.py). Without quotas a put takes the tier's least recently used.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping


class TierIndex:
    """The slots of one tier, by block hash, least recently used first."""

    def __init__(self, num_slots: int, medium: str, quotas: Mapping[str, int] | None = None) -> None:
        if num_slots < 1:
            raise ValueError(f"a {medium} tier needs at least one block, got {num_slots}")
        self.num_slots = num_slots
        self.medium = medium  # its name in KV events (worker/kv_events.py)
        self._slots: OrderedDict[bytes, int] = OrderedDict()  # hash -> slot, LRU first
        self._free = list(range(num_slots - 1, -1, -1))  # slot 0 handed out first
        self._pinned: set[int] = set()
        self._held: set[int] = set()  # slots a read in flight fills (see `hold`)
        self._kept: dict[bytes, int] = {}  # hash -> the pins of documents keeping it (see `keep`)
        self.quotas = dict(quotas) if quotas else None  # tenant -> its quota in slots
        self._owner: dict[bytes, str] = {}  # hash -> its tenant (quotas only)
        self._of: dict[str, OrderedDict[bytes, None]] = {}  # tenant -> its hashes, LRU first
        self.victim_tenant = ""  # the tenant of the hash the last `put` evicted
        self.evictions_caused: dict[str, int] = {}  # tenant -> its puts' victims (quotas only)
        self.evictions_suffered: dict[str, int] = {}  # tenant -> its blocks evicted (quotas only)

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._slots

    def get(self, block_hash: bytes) -> int | None:
        """The slot holding `block_hash`, or None."""
        return self._slots.get(block_hash)

    def hashes(self) -> Iterator[bytes]:
        """Every hash the tier holds, LRU first: its inventory."""
        return iter(list(self._slots))

    def touch(self, block_hash: bytes) -> None:
        """`block_hash` was used: last in eviction order."""
        self._slots.move_to_end(block_hash)
        if self.quotas is not None:
            self._of[self._owner[block_hash]].move_to_end(block_hash)

    def owner(self, block_hash: bytes) -> str:
        """The tenant `block_hash` belongs to ("" without quotas)."""
        return self._owner.get(block_hash, "")

    def tenant_blocks(self) -> dict[str, int]:
        """Tenant -> the blocks of its the tier holds (empty without quotas)."""
        return {t: len(hs) for t, hs in self._of.items() if hs}

    def pin(self, slot: int) -> None:
        """Keep `slot` from being reused until `unpin_all` (the step that reads it is handed over)."""
        self._pinned.add(slot)

    def unpin_all(self) -> None:
        self._pinned.clear()

    def hold(self, slot: int) -> None:
        """Keep `slot` from being reused across steps until `release`: a read fills it."""
        self._held.add(slot)

    def release(self, slot: int) -> None:
        self._held.discard(slot)

    def keep(self, hashes) -> None:
        """Pin `hashes` in the tier for a document: never evicted while kept (`unkeep`)."""
        kept = self._kept
        for h in hashes:
            kept[h] = kept.get(h, 0) + 1

    def unkeep(self, hashes) -> None:
        """Drop one document pin of each of `hashes` (as `keep` took them)."""
        kept = self._kept
        for h in hashes:
            count = kept.pop(h, 0)
            if count > 1:
                kept[h] = count - 1

    @property
    def num_kept(self) -> int:
        """Hashes that documents keep in the tier (held by it or still to come)."""
        return len(self._kept)

    @property
    def num_held(self) -> int:
        """Slots held by reads in flight."""
        return len(self._held)

    def put(self, block_hash: bytes, tenant: str = "") -> tuple[int, bytes | None] | None:
        """A slot for `block_hash` (pinned), `tenant`'s: a free one or the least recently used
        unpinned one (with quotas, of the tenant furthest over its quota), whose hash is
        evicted: (slot, the evicted hash or None; its tenant is `victim_tenant`). None when
        every slot is pinned in this step: the block is not kept."""
        assert block_hash not in self._slots, "a hash put twice"
        evicted = None
        if self._free:
            slot = self._free.pop()
        else:
            found = self._victim(tenant) if self.quotas is not None else self._lru(self._slots)
            if found is None:
                return None
            evicted, slot = found
            del self._slots[evicted]
            self.victim_tenant = self._forget_owner(evicted)
            if self.quotas is not None:
                self.evictions_caused[tenant] = self.evictions_caused.get(tenant, 0) + 1
                suffered = self.victim_tenant
                self.evictions_suffered[suffered] = self.evictions_suffered.get(suffered, 0) + 1
        self._slots[block_hash] = slot
        self._pinned.add(slot)
        if self.quotas is not None:
            self._owner[block_hash] = tenant
            self._of.setdefault(tenant, OrderedDict())[block_hash] = None
        return slot, evicted

    def _lru(self, hashes) -> tuple[bytes, int] | None:
        """The first of `hashes` (LRU first) whose slot is neither pinned nor held, and that no
        document keeps."""
        slots, pinned, held, kept = self._slots, self._pinned, self._held, self._kept
        for h in hashes:
            s = slots[h]
            if s not in pinned and s not in held and h not in kept:
                return h, s
        return None

    def _victim(self, putter: str) -> tuple[bytes, int] | None:
        """With quotas: the least recently used free-to-take slot of the tenant furthest over
        its quota once `putter`'s block is in (so that a tenant at its quota makes room from
        its own blocks), then of the next, and so on."""
        quotas, of = self.quotas, self._of

        def excess(t: str) -> int:
            return len(of[t]) + (t == putter) - quotas.get(t, 0)

        order = sorted(of, key=excess, reverse=True)
        for tenant in order:
            if (found := self._lru(self._of[tenant])) is not None:
                return found
        return None

    def _forget_owner(self, block_hash: bytes) -> str:
        tenant = self._owner.pop(block_hash, "")
        if self.quotas is not None:
            self._of[tenant].pop(block_hash, None)
        return tenant

    def drop(self, block_hash: bytes) -> int | None:
        """Forget `block_hash` (a failed read); its slot is free again. Returns the slot."""
        slot = self._slots.pop(block_hash, None)
        if slot is not None:
            self._free.append(slot)
            self._forget_owner(block_hash)
        return slot

    def clear(self) -> None:
        self._slots.clear()
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._pinned.clear()
        self._held.clear()
        self._owner.clear()
        self._of.clear()
