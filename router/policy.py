"""Placement policies: which group gets a request, given the index's matches and the loads.

`prefix_aware` (the default) picks the group with the lowest estimated time to first token:
the prefill still to compute there (the prompt minus the blocks the group holds or has pending)
on top of the group's queued prefill work, under its running decodes, plus a charge for the
cached blocks the new ones would evict. A hot document's holder therefore keeps its questions
until its queue costs more than prefilling the document elsewhere; then the request spills and
the other group caches the document too (replication follows load), up to `max_replicas`
holders. Ties go by rendezvous hashing of the chain's first block, so that idle groups split
new documents evenly and every router replica breaks a tie the same way.

Baselines: `round_robin`, `least_loaded`, `prefix_hash` (rendezvous hashing of the first block)
and `oracle` (perfect document affinity, for the routing benchmark only).
"""

from __future__ import annotations

import hashlib
import itertools
import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from cluster.group import GroupStatus
from cluster.prefix_index import GroupMatch
from cluster.sim_group import CostModel


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


def _first(block_hashes: Sequence[bytes]) -> bytes:
    return block_hashes[0] if block_hashes else b""


def _cached(matches: Mapping[str, GroupMatch], gid: str) -> int:
    m = matches.get(gid)
    return 0 if m is None else m.expected_blocks


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._next = itertools.count()

    def choose(self, block_hashes, statuses, matches) -> Placement:
        ids = sorted(statuses)
        gid = ids[next(self._next) % len(ids)]
        return Placement(gid, self.name, _cached(matches, gid))


class LeastLoaded(Policy):
    """Fewest queued prefill tokens, then fewest running sequences; ties by rendezvous."""

    name = "least_loaded"

    def choose(self, block_hashes, statuses, matches) -> Placement:
        key = _first(block_hashes)
        gid = min(
            statuses,
            key=lambda g: (
                statuses[g].pending_prefill_tokens,
                statuses[g].running,
                bytes(255 - b for b in rendezvous(key, g)),
            ),
        )
        return Placement(gid, self.name, _cached(matches, gid))


class PrefixHash(Policy):
    """Consistent (rendezvous) hashing of the first block over the live groups; load-blind."""

    name = "prefix_hash"

    def choose(self, block_hashes, statuses, matches) -> Placement:
        key = _first(block_hashes)
        gid = max(statuses, key=lambda g: rendezvous(key, g))
        return Placement(gid, self.name, _cached(matches, gid))


@dataclass(frozen=True)
class PrefixAwareConfig:
    """The time model behind `prefix_aware` (seconds from the group's calibrated cost model)."""

    cost: CostModel = field(default_factory=CostModel)
    max_num_batched_tokens: int = 2048  # a group's token budget per step
    # Fraction of an evicted block's recompute charged to the placement that evicts it: the
    # chance that the (least recently used) block would have been hit again.
    eviction_weight: float = 0.5
    # Most groups a prefix spills onto; None: half the live groups (at least 2).
    max_replicas: int | None = None
    # Decode steps a request is expected to run: each request already running or waiting on a
    # group slows every step there by cost.decode_seq_s for about that many steps, so a
    # placement is charged request_weight * decode_tokens * decode_seq_s per such request
    # (the time it adds to its neighbours and they add to it). 0 ignores request counts.
    decode_tokens: int = 32
    request_weight: float = 1.0
    # Hot prefixes get replicas in proportion to their demand: a first block seen in a share
    # s of the last ~demand_window placements wants ceil(s * live groups * replica_headroom)
    # holders (at most max_replicas), and until it has them each request on it goes to a group
    # that does not hold it. Measured on the loose 16-group trace (benchmarks/routing.py):
    # without it the hot document's holders take 1.5-1.6x the mean request count.
    demand_window: int = 1000
    replica_headroom: float = 1.5

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")  # fmt: skip
        if not self.eviction_weight >= 0:
            raise ValueError(f"eviction_weight must be >= 0, got {self.eviction_weight}")
        if self.decode_tokens < 0:
            raise ValueError(f"decode_tokens must be >= 0, got {self.decode_tokens}")
        if not self.request_weight >= 0:
            raise ValueError(f"request_weight must be >= 0, got {self.request_weight}")
        if self.max_replicas is not None and self.max_replicas < 1:
            raise ValueError(f"max_replicas must be >= 1, got {self.max_replicas}")
        if self.demand_window < 1:
            raise ValueError(f"demand_window must be >= 1, got {self.demand_window}")
        if not self.replica_headroom >= 0:
            raise ValueError(f"replica_headroom must be >= 0, got {self.replica_headroom}")


class PrefixAware(Policy):
    """Lowest estimated time to first token; see the module docstring."""

    name = "prefix_aware"

    def __init__(self, config: PrefixAwareConfig | None = None) -> None:
        self.config = config or PrefixAwareConfig()
        self.demand = Demand(self.config.demand_window)

    def estimate(self, n_blocks: int, hit_blocks: int, status: GroupStatus) -> float:
        """Estimated seconds to the first token of an `n_blocks` prompt on this group."""
        c, bs = self.config.cost, self.block_size
        new_tokens = (n_blocks - min(hit_blocks, n_blocks)) * bs + bs // 2  # + the partial tail
        work = status.pending_prefill_tokens + new_tokens
        steps = math.ceil(work / self.config.max_num_batched_tokens)
        ttft = work * c.prefill_token_s + steps * (c.step_s + status.running * c.decode_seq_s)
        evicted = max(0, math.ceil(new_tokens / bs) - _empty(status))
        requests = status.running + status.waiting
        neighbours = self.config.request_weight * requests * self.config.decode_tokens * c.decode_seq_s  # fmt: skip
        return ttft + self.config.eviction_weight * evicted * bs * c.prefill_token_s + neighbours

    def choose(self, block_hashes, statuses, matches) -> Placement:
        n, key = len(block_hashes), _first(block_hashes)
        share = self.demand.observe(key) if block_hashes else 0.0
        hits = {g: min(_cached(matches, g), n) for g in statuses}
        best_hit = max(hits.values())
        candidates = list(statuses)
        if best_hit > 0:
            holders = [g for g in statuses if 2 * hits[g] >= best_hit]
            cap = self.config.max_replicas or max(2, len(statuses) // 2)
            wanted = min(cap, math.ceil(share * len(statuses) * self.config.replica_headroom))
            if len(holders) >= cap:  # replication is bounded: stay on the holders
                candidates = holders
            elif len(holders) < wanted:  # a hot prefix short of replicas: add one
                candidates = [g for g in statuses if g not in holders]
            # Otherwise every group competes: a holder wins unless its queue costs more.
        scored = {g: self.estimate(n, hits[g], statuses[g]) for g in candidates}
        gid = min(candidates, key=lambda g: (scored[g], _rank(key, g)))
        if best_hit == 0:
            reason = "new_prefix"
        elif hits[gid] == best_hit:
            reason = "prefix_hit"
        else:
            reason = "spill"
        return Placement(gid, reason, hits[gid])


class Demand:
    """Each first block's share of the last ~`window` placements (exponentially decayed)."""

    def __init__(self, window: int) -> None:
        self.decay = 1.0 - 1.0 / window
        self.window = window
        self._counts: dict[bytes, tuple[float, int]] = {}  # key -> (count, at placement number)
        self._n = 0

    def observe(self, key: bytes) -> float:
        """Count one placement of `key`; returns its share of the last ~window placements.

        The share is over the full window even before `window` placements were seen, so a
        fresh router underestimates demand instead of taking its first documents for hot ones."""
        self._n += 1
        count, at = self._counts.get(key, (0.0, self._n))
        count = count * self.decay ** (self._n - at) + 1.0
        self._counts[key] = (count, self._n)
        if len(self._counts) > 8 * self.window:  # forget keys that decayed to nothing
            floor = self.decay ** (4 * self.window)
            self._counts = {
                k: (c, a) for k, (c, a) in self._counts.items() if c * self.decay ** (self._n - a) > floor
            }  # fmt: skip
        return count / self.window


def _empty(status: GroupStatus) -> int:
    """Blocks with no content and no reference; cached ones are counted as taken."""
    return max(0, status.blocks_free - status.blocks_cached)


def _rank(key: bytes, group_id: str) -> bytes:
    """Tie-break order: the group with the highest rendezvous score sorts first."""
    return bytes(255 - b for b in rendezvous(key, group_id))


class Oracle(Policy):
    """Perfect document affinity, for the routing benchmark: the benchmark names each request's
    document with `expect(key, tokens)`; a document's first request goes to the group with the
    fewest document tokens assigned so far, and every later one follows it. Requests without a
    document go to the least loaded group."""

    name = "oracle"

    def __init__(self) -> None:
        self._home: dict[str, str] = {}
        self._assigned: dict[str, int] = {}
        self._key: tuple[str, int] | None = None
        self._fallback = LeastLoaded()

    def expect(self, key: str | None, tokens: int = 0) -> None:
        self._key = None if key is None else (key, tokens)

    def choose(self, block_hashes, statuses, matches) -> Placement:
        expected, self._key = self._key, None
        if expected is None:
            return self._fallback.choose(block_hashes, statuses, matches)
        key, tokens = expected
        home = self._home.get(key)
        if home not in statuses:
            home = min(statuses, key=lambda g: (self._assigned.get(g, 0), g))
            self._home[key] = home
            self._assigned[home] = self._assigned.get(home, 0) + tokens
        return Placement(home, self.name, _cached(matches, home))


POLICIES: dict[str, type[Policy]] = {
    p.name: p for p in (RoundRobin, LeastLoaded, PrefixHash, PrefixAware, Oracle)
}


def make_policy(name: str, block_size: int = 16) -> Policy:
    """A policy by name (see POLICIES) for blocks of `block_size` tokens."""
    if name not in POLICIES:
        raise ValueError(f"policy {name!r} is unknown; choose one of {sorted(POLICIES)}")
    policy = POLICIES[name]()
    policy.block_size = block_size
    return policy
