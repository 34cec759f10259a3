"""Placement policies: which group gets a request, given the index's matches and the loads."""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from cluster.group import GroupStatus
from cluster.prefix_index import GroupMatch


@dataclass(frozen=True)
class Placement:
    group_id: str
    reason: str  # why: "prefix_hit", "least_loaded", "round_robin", "spill", ...
    cached_blocks: int = 0  # leading blocks the index says the group holds (or has pending)


class Policy(ABC):
    """Chooses a group among the live ones."""

    name: str

    @abstractmethod
    def choose(
        self,
        block_hashes: Sequence[bytes],
        statuses: Mapping[str, GroupStatus],
        matches: Mapping[str, GroupMatch],
    ) -> Placement:
        """`statuses`: live groups (non-empty); `matches`: the index's answer per group."""


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._next = itertools.count()

    def choose(self, block_hashes, statuses, matches) -> Placement:
        ids = sorted(statuses)
        gid = ids[next(self._next) % len(ids)]
        return Placement(gid, self.name, _cached(matches, gid))


class LeastLoaded(Policy):
    name = "least_loaded"

    def choose(self, block_hashes, statuses, matches) -> Placement:
        gid = min(
            statuses, key=lambda g: (statuses[g].pending_prefill_tokens, statuses[g].running, g)
        )
        return Placement(gid, self.name, _cached(matches, gid))


class PrefixAware(Policy):
    """The longest cached prefix wins, unless that group is much busier (a simple first rule;
    the measured policy lives with the routing benchmark)."""

    name = "prefix_aware"

    def choose(self, block_hashes, statuses, matches) -> Placement:
        def key(g: str):
            s = statuses[g]
            return (-_cached(matches, g), s.pending_prefill_tokens + s.running, g)

        gid = min(statuses, key=key)
        cached = _cached(matches, gid)
        return Placement(gid, "prefix_hit" if cached else "least_loaded", cached)


def _cached(matches: Mapping[str, GroupMatch], gid: str) -> int:
    m = matches.get(gid)
    return 0 if m is None else m.expected_blocks


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (RoundRobin, LeastLoaded, PrefixAware)}


def make_policy(name: str) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"policy {name!r} is unknown; choose one of {sorted(POLICIES)}")
    return POLICIES[name]()
