"""Where a request goes: a `Placement`, and the `Policy` interface that chooses it from the live
groups' statuses, the prefix index's matches and this router's recent placements
(`PlacedShare`, kept by the router's ledger, router/placement/ledger.py)."""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from cluster.group import GroupStatus
from cluster.index import GroupMatch
from worker.outputs import CachedTiers


@dataclass(frozen=True)
class Placement:
    group_id: str
    reason: str  # why: "prefix_hit", "spill", "new_prefix", "least_loaded", "round_robin", ...
    cached_blocks: int = 0  # leading blocks the index says the group holds (or has pending)
    # another live group holding more of the prefix, which the chosen one pulls it from first
    # (router/router.py: `pull_source`), and the leading blocks that group holds
    pull_from: str | None = None
    pull_blocks: int = 0
    # the source has those blocks pending (sent, not yet committed): the pull waits for them
    # (router/router.py: `cold_source`, COLD_WAIT_S)
    pull_wait: bool = False
    # the chosen group's lead as the index had it, in blocks, each tier with those above it:
    # on the device (or pending there), then with the host tier, then with the disk tier
    # (set by the router: router/router.py, `Router.place`)
    tier_lead: tuple[int, int, int] = (0, 0, 0)

    def cached_tiers(self, prompt_tokens: int, block_size: int) -> CachedTiers:
        """`cached_tokens` by the tier the placement expects them from: the lead's device,
        host and disk parts, and the blocks beyond it pulled (with a source) or, without one,
        on the device (a policy's prediction beyond the index)."""
        c = self.cached_blocks
        device, host, disk = (min(c, n) for n in self.tier_lead)
        beyond = c - max(device, host, disk)
        pull = beyond if self.pull_from is not None else 0
        host, disk = max(0, host - device), max(0, disk - max(device, host))
        tiers = CachedTiers(device + beyond - pull, host, disk, pull)
        return CachedTiers(*(n * block_size for n in tiers)).clipped(self.cached_tokens(prompt_tokens, block_size))

    def cached_tokens(self, prompt_tokens: int, block_size: int) -> int:
        """The prompt tokens the placement predicts the group serves from its cache: whole
        blocks, never the one holding the last prompt token (the engine computes that token, so
        a hit stops a block before it, as worker/engine/block_manager.py's match does)."""
        return min(self.cached_blocks, (prompt_tokens - 1) // block_size) * block_size


class PlacedShare:
    """Each group's part of a router's last ~`window` x (live groups) placements, exponentially
    decayed: the requests placed there and the prompt tokens they sent there uncached.

    Stored values are the decayed ones divided by the product of the decays so far, so a
    placement updates one entry instead of decaying every group's."""

    def __init__(self, window: int = 200) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window  # placements per live group
        self._scale = 1.0  # the product of the decays since the last renormalization
        self._requests: dict[str, float] = {}
        self._tokens: dict[str, float] = {}

    def add(self, group_id: str, new_tokens: int, live_groups: int = 1) -> None:
        """Count one placement on `group_id` that sends it `new_tokens` uncached tokens."""
        self._scale *= 1.0 - 1.0 / (self.window * max(1, live_groups))
        if self._scale < 1e-100:  # renormalize before the stored values overflow
            for counts in (self._requests, self._tokens):
                for g in counts:
                    counts[g] *= self._scale
            self._scale = 1.0
        self._requests[group_id] = self._requests.get(group_id, 0.0) + 1.0 / self._scale
        self._tokens[group_id] = self._tokens.get(group_id, 0.0) + new_tokens / self._scale

    def raw(self) -> tuple[dict[str, float], dict[str, float], float]:
        """(requests, tokens, scale): each group's stored placements and uncached tokens; a
        decayed count is the stored value times `scale`. Read-only views for one decision."""
        return self._requests, self._tokens, self._scale


class Policy(ABC):
    """Chooses a group among the live ones."""

    name: str

    def __init__(self, block_size: int = 16) -> None:
        self.block_size = block_size  # tokens per KV block: the model's

    @abstractmethod
    def choose(
        self,
        block_hashes: Sequence[bytes],
        statuses: Mapping[str, GroupStatus],
        matches: Mapping[str, GroupMatch],
        placed: PlacedShare,
    ) -> Placement:
        """`statuses`: live groups (non-empty); `matches`: the index's answer per group;
        `placed`: this router's recent placements (the ledger counts this one after)."""

    def placed_window(self) -> int:
        """How many recent placements per live group the ledger's share should remember."""
        return 200


def rendezvous(key: bytes, group_id: str) -> bytes:
    """Highest-random-weight score of `group_id` for `key` (larger wins); the same everywhere."""
    return hashlib.blake2b(key + group_id.encode(), digest_size=8).digest()


def first_block(block_hashes: Sequence[bytes]) -> bytes:
    return block_hashes[0] if block_hashes else b""


def cached_blocks(matches: Mapping[str, GroupMatch], gid: str) -> int:
    m = matches.get(gid)
    return 0 if m is None else m.expected_blocks
