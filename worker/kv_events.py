"""KV events: what a group's prefix cache gained or lost, in order.

The block manager emits them to a sink that its owner injects; the prefix index (cluster/) is
built from exactly these events, so it knows which blocks each group holds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Consecutive blocks of one hash chain became cached; `parent_hash` precedes the first."""

    block_hashes: tuple[bytes, ...]
    parent_hash: bytes | None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks were evicted from the prefix cache."""

    block_hashes: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The whole prefix cache was dropped."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
KVEventSink = Callable[[KVEvent], None]


def discard_events(event: KVEvent) -> None:
    """The sink used when nobody listens."""
