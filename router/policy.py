"""Placement policies by name: the baselines `round_robin`, `least_loaded`, `prefix_hash`
(rendezvous hashing of the first block) and `oracle` (perfect document affinity, for the routing
benchmark only; its balanced peer is the benchmark's own), and `prefix_aware`, the default
(router/prefix_aware.py). `make_policy` builds one by name with its options."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import fields

from cluster.sim_group import CostModel
from router.placement import Placement, Policy, cached_blocks, first_block, rendezvous
from router.prefix_aware import PrefixAware, PrefixAwareConfig

__all__ = [
    "POLICIES",
    "LeastLoaded",
    "Oracle",
    "Placement",
    "Policy",
    "PrefixAware",
    "PrefixAwareConfig",
    "PrefixHash",
    "RoundRobin",
    "make_policy",
    "rendezvous",
]


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._next = itertools.count()

    def choose(self, block_hashes, statuses, matches) -> Placement:
        ids = sorted(statuses)
        gid = ids[next(self._next) % len(ids)]
        return Placement(gid, self.name, cached_blocks(matches, gid))


class LeastLoaded(Policy):
    """Fewest queued prefill tokens, then fewest running sequences; ties by rendezvous."""

    name = "least_loaded"

    def choose(self, block_hashes, statuses, matches) -> Placement:
        key = first_block(block_hashes)
        gid = min(
            statuses,
            key=lambda g: (
                statuses[g].pending_prefill_tokens,
                statuses[g].running,
                bytes(255 - b for b in rendezvous(key, g)),
            ),
        )
        return Placement(gid, self.name, cached_blocks(matches, gid))


class PrefixHash(Policy):
    """Consistent (rendezvous) hashing of the first block over the live groups; load-blind."""

    name = "prefix_hash"

    def choose(self, block_hashes, statuses, matches) -> Placement:
        key = first_block(block_hashes)
        gid = max(statuses, key=lambda g: rendezvous(key, g))
        return Placement(gid, self.name, cached_blocks(matches, gid))


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
        return Placement(home, self.name, cached_blocks(matches, home))


POLICIES: dict[str, type[Policy]] = {
    p.name: p for p in (RoundRobin, LeastLoaded, PrefixHash, PrefixAware, Oracle)
}


def make_policy(name: str, block_size: int = 16, options: Mapping | None = None) -> Policy:
    """A policy by name (see POLICIES) for blocks of `block_size` tokens. `options`: fields of
    PrefixAwareConfig for `prefix_aware` (`cost` as a mapping of CostModel fields)."""
    if name not in POLICIES:
        raise ValueError(f"policy {name!r} is unknown; choose one of {sorted(POLICIES)}")
    options = dict(options or {})
    if name == "prefix_aware":
        known = {f.name for f in fields(PrefixAwareConfig)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown policy option(s) {unknown}; known: {sorted(known)}")
        if isinstance(options.get("cost"), Mapping):
            options["cost"] = CostModel(**options["cost"])
        policy: Policy = PrefixAware(PrefixAwareConfig(**options))
    elif options:
        raise ValueError(f"policy {name!r} takes no options, got {sorted(options)}")
    else:
        policy = POLICIES[name]()
    policy.block_size = block_size
    return policy
