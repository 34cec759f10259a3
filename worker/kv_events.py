"""KV events: what a group's prefix cache gained or lost, in order.

The block manager emits them to a sink that its owner injects; the prefix index (cluster/) is
built from exactly these events, so it knows which blocks each group holds.

Each store and removal names its `medium`, the tier the block entered or left (as vLLM's
`BlockStored.medium`): "device" (the paged pool), "host" (host memory under it) or "disk".
A block evicted from the device and kept on the host is a removal on "device" and a store on
"host"; a block restored from the host is a store on "device" (the host keeps its copy). The
default, "device", is what a consumer that knows no tiers reads (the prefix index keeps each
tier's blocks: cluster/index/).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

DEVICE, HOST, DISK = "device", "host", "disk"
MEDIUMS = (DEVICE, HOST, DISK)


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Consecutive blocks of one hash chain became cached; `parent_hash` precedes the first."""

    block_hashes: tuple[bytes, ...]
    parent_hash: bytes | None
    medium: str = DEVICE  # the tier they entered


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks were evicted from the prefix cache (of `medium`)."""

    block_hashes: tuple[bytes, ...]
    medium: str = DEVICE  # the tier they left


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The whole prefix cache was dropped, every tier's."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
KVEventSink = Callable[[KVEvent], None]


def discard_events(event: KVEvent) -> None:
    """The sink used when nobody listens."""
