"""The prefix index's vocabulary: a match's answer, a pending write, inventory sizes, the
timing configuration, the errors, and the rule for names.

The index carries what groups hold, not how busy they are: a router weighs load from its groups'
own status (cluster/group.py: `GroupStatus`), which reaches it with every batch of outputs."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from worker.kv_events import MEDIUMS


class GroupMatch(NamedTuple):
    """What one live group holds of a queried chain. A named tuple: a match builds one per
    group it touches, at a quarter of a frozen dataclass's cost; `_replace` for a changed copy.

    The chain is followed across the group's tiers as its block manager follows it: `blocks`
    lead on the device; after them, `host_blocks` more continue with every block on the
    device or the host tier, then `disk_blocks` more with every block in some tier. A reader
    that knows no tiers reads `blocks` alone (the two lower counts default to 0)."""

    group_id: str
    epoch: int
    blocks: int  # leading blocks of the chain cached on the group's device pool
    pending_blocks: int  # leading blocks of the chain pending (recently placed) on the group
    host_blocks: int = 0  # blocks after `blocks` restored from the host tier (or on the device)
    disk_blocks: int = 0  # blocks after those fetched from the disk tier (or above it)

    @property
    def expected_blocks(self) -> int:
        """Leading blocks the group holds on its device or is about to hold."""
        return max(self.blocks, self.pending_blocks)

    @property
    def tier_blocks(self) -> int:
        """Leading blocks of the chain the group holds in any tier."""
        return self.blocks + self.host_blocks + self.disk_blocks


class Matches(dict[str, GroupMatch]):
    """A match's answer: every live group's `GroupMatch` by id, and `touched`, the ids of those
    whose answer may hold or have pending a leading block (every other one answers 0 and 0).
    A policy reads the touched answers only, not one per live group."""

    __slots__ = ("touched",)

    def __init__(self, answers: Mapping[str, GroupMatch] | None = None, touched: Iterable[str] = ()) -> None:
        super().__init__(answers or ())
        self.touched: list[str] = list(touched)


def touched_ids(matches: Mapping[str, GroupMatch]) -> Sequence[str]:
    """The ids whose answer may have a hit: `touched` of a `Matches`, else every id."""
    return matches.touched if isinstance(matches, Matches) else list(matches)


# Names become parts of Redis keys: no separators, spaces or hash-tag braces.
_NAME = re.compile(r"[A-Za-z0-9_.\-/@+=]{1,128}")


def check_name(field_name: str, value: str) -> str:
    """`value` if it is a usable cluster, model or group name, else ValueError naming the field."""
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise ValueError(f"{field_name} must match {_NAME.pattern}, got {value!r}")
    return value


def check_medium(medium: str) -> str:
    """`medium` if a KV event may name it (worker/kv_events.py), else ValueError."""
    if medium not in MEDIUMS:
        raise ValueError(f"medium must be one of {', '.join(MEDIUMS)}, got {medium!r}")
    return medium


class PrefixIndexError(Exception):
    """Base of the errors a prefix index raises for reasons outside the caller's arguments."""


class StaleEpochError(PrefixIndexError):
    """The (group, epoch) is not the group's live registration: superseded, expired or gone."""


class IndexUnavailableError(PrefixIndexError):
    """The shared index cannot be reached (Redis down, timed out, refusing writes)."""


@dataclass(frozen=True)
class PrefixIndexConfig:
    """Liveness and pending-placement timing shared by both backends."""

    # A group is dead once this long passes without a heartbeat, publish or load report;
    # three heartbeat intervals tolerate two lost beats.
    heartbeat_ttl_s: float = 3.0
    # A placement shows as pending this long unless record_pending is given its own TTL; long
    # enough for the group to prefill and publish the blocks, short enough to forget failures.
    pending_ttl_s: float = 2.0
    # Keys sampled with MEMORY USAGE by inventory_stats (Redis backend).
    stats_sample_keys: int = 64

    def __post_init__(self) -> None:
        if not self.heartbeat_ttl_s > 0:
            raise ValueError(f"heartbeat_ttl_s must be > 0, got {self.heartbeat_ttl_s}")
        if not self.pending_ttl_s > 0:
            raise ValueError(f"pending_ttl_s must be > 0, got {self.pending_ttl_s}")
        if self.stats_sample_keys < 1:
            raise ValueError(f"stats_sample_keys must be >= 1, got {self.stats_sample_keys}")


@dataclass(frozen=True)
class PendingWrite:
    """One placement for `PrefixIndex.record_pending_many`."""

    group_id: str
    block_hashes: Sequence[bytes]  # the placed chain
    # Leading probes (`probe_positions`) the writer recorded on this group less than half a
    # pending TTL ago: a backend may keep their deadline and write only the rest.
    fresh_probes: int = 0


@dataclass(frozen=True)
class InventoryStats:
    """Size of the index over its live groups."""

    entries: int  # (group, block) pairs
    blocks: int  # distinct block hashes held by at least one group
    groups: int  # live groups
    bytes_per_block: float | None = None  # Redis memory per entry; None in memory
    bytes_total: int | None = None  # Redis memory of all entries (MEMORY USAGE estimate)
    # Redis memory of the change log that routers' mirrors follow (cluster/index/mirror.py):
    # recent writes, about LOG_MAX_ENTRIES of them, not part of bytes_total.
    log_bytes: int | None = None
    # (group, block) pairs of the live groups' tiers under the pool: host and disk
    lower_entries: int = 0


# One group's inventory per medium (worker/kv_events.py: "device", "host", "disk").
TierInventory = Mapping[str, frozenset[bytes]]


@dataclass(frozen=True)
class IndexHealth:
    """What a router's reader knows of its index without a round trip, for its metrics: whether
    the shared index answers, how far behind the router's mirror of it is, and the inventory as
    this router routes on it (live groups' entries)."""

    shared: bool  # a shared index (Redis) behind the reader; False: in-process only
    reachable: bool  # the shared index answered lately (always True in process)
    # Seconds since the router's mirror last read the index's change log (inf: never in sync
    # yet); None without a mirror.
    mirror_lag_s: float | None
    entries: int  # (group, block) pairs of live groups
    blocks: int  # distinct block hashes held
    groups: int  # live groups
