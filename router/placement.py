"""Where a request goes: a `Placement`, and the `Policy` interface that chooses it from the live
groups' statuses and the prefix index's matches (router/policy.py: the baselines and the registry;
router/prefix_aware.py: the default)."""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from cluster.group import GroupStatus
from cluster.index import GroupMatch


@dataclass(frozen=True)
class Placement:
    group_id: str
    reason: str  # why: "prefix_hit", "spill", "new_prefix", "least_loaded", "round_robin", ...
    cached_blocks: int = 0  # leading blocks the index says the group holds (or has pending)


class Policy(ABC):
    """Chooses a group among the live ones."""

    name: str
    block_size: int = 16  # tokens per block; the router sets the model's

    @abstractmethod
    def choose(
        self,
        block_hashes: Sequence[bytes],
        statuses: Mapping[str, GroupStatus],
        matches: Mapping[str, GroupMatch],
    ) -> Placement:
        """`statuses`: live groups (non-empty); `matches`: the index's answer per group."""


def rendezvous(key: bytes, group_id: str) -> bytes:
    """Highest-random-weight score of `group_id` for `key` (larger wins); the same everywhere."""
    return hashlib.blake2b(key + group_id.encode(), digest_size=8).digest()


def first_block(block_hashes: Sequence[bytes]) -> bytes:
    return block_hashes[0] if block_hashes else b""


def cached_blocks(matches: Mapping[str, GroupMatch], gid: str) -> int:
    m = matches.get(gid)
    return 0 if m is None else m.expected_blocks
