"""Placement policies by name: the baselines `round_robin`, `least_loaded` and `prefix_hash`
(rendezvous hashing of the first block), and `prefix_aware`, the default
(router/placement/prefix_aware.py). `make_policy` builds one by name with its options. (The
routing benchmark's oracles are benchmarks/oracles.py.)"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import fields

from cluster.cost_model import CostModel
from router.placement.policy import Placement, Policy, cached_blocks, first_block, rendezvous
from router.placement.prefix_aware import PrefixAware, PrefixAwareConfig


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self, block_size: int = 16) -> None:
        super().__init__(block_size)
        self._next = itertools.count()

    def choose(self, block_hashes, statuses, matches, placed) -> Placement:
        ids = sorted(statuses)
        gid = ids[next(self._next) % len(ids)]
        return Placement(gid, self.name, cached_blocks(matches, gid))


class LeastLoaded(Policy):
    """Fewest queued prefill tokens, then fewest running sequences; ties by rendezvous."""

    name = "least_loaded"

    def choose(self, block_hashes, statuses, matches, placed) -> Placement:
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

    def choose(self, block_hashes, statuses, matches, placed) -> Placement:
        key = first_block(block_hashes)
        gid = max(statuses, key=lambda g: rendezvous(key, g))
        return Placement(gid, self.name, cached_blocks(matches, gid))


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (RoundRobin, LeastLoaded, PrefixHash, PrefixAware)}


def make_policy(name: str, block_size: int = 16, batch_tokens: int = 2048, options: Mapping | None = None) -> Policy:
    """A policy by name (see POLICIES) for the engine's blocks of `block_size` tokens and its
    token budget per step, `batch_tokens`. `options`: fields of PrefixAwareConfig for
    `prefix_aware` (`cost` as a mapping of CostModel fields)."""
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
        return PrefixAware(PrefixAwareConfig(**options), block_size, batch_tokens)
    if options:
        raise ValueError(f"policy {name!r} takes no options, got {sorted(options)}")
    return POLICIES[name](block_size)
