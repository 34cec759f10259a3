"""Which blocks a tier under the device pool (host memory, disk) holds: hash -> slot, LRU.

Pure Python, no torch, as the block manager it serves: it names slots; each rank's tier
(worker/exec/host_tier.py) owns the bytes. A slot that a step reads or writes is pinned until
the step is handed over (`unpin_all`), so that no later decision of the same step reuses it:
every rank then makes the step's copies in one fixed order (worker/step.py `KVMoves`). A slot
that a fetch from the disk fills off the step's path is held across steps (`hold`) until its
read is done on every rank (`release`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator


class TierIndex:
    """The slots of one tier, by block hash, least recently used first."""

    def __init__(self, num_slots: int, medium: str) -> None:
        if num_slots < 1:
            raise ValueError(f"a {medium} tier needs at least one block, got {num_slots}")
        self.num_slots = num_slots
        self.medium = medium  # its name in KV events (worker/kv_events.py)
        self._slots: OrderedDict[bytes, int] = OrderedDict()  # hash -> slot, LRU first
        self._free = list(range(num_slots - 1, -1, -1))  # slot 0 handed out first
        self._pinned: set[int] = set()
        self._held: set[int] = set()  # slots a read in flight fills (see `hold`)

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

    @property
    def num_held(self) -> int:
        """Slots held by reads in flight."""
        return len(self._held)

    def put(self, block_hash: bytes) -> tuple[int, bytes | None] | None:
        """A slot for `block_hash` (pinned), a free one or the least recently used unpinned
        one, whose hash is evicted: (slot, the evicted hash or None). None when every slot is
        pinned in this step: the block is not kept."""
        assert block_hash not in self._slots, "a hash put twice"
        evicted = None
        if self._free:
            slot = self._free.pop()
        else:
            for h, s in self._slots.items():
                if s not in self._pinned and s not in self._held:
                    evicted, slot = h, s
                    break
            else:
                return None
            del self._slots[evicted]
        self._slots[block_hash] = slot
        self._pinned.add(slot)
        return slot, evicted

    def drop(self, block_hash: bytes) -> int | None:
        """Forget `block_hash` (a failed read); its slot is free again. Returns the slot."""
        slot = self._slots.pop(block_hash, None)
        if slot is not None:
            self._free.append(slot)
        return slot

    def clear(self) -> None:
        self._slots.clear()
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._pinned.clear()
        self._held.clear()
