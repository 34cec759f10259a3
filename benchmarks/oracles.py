"""Placements that know the whole trace, for the routing benchmark to measure policies against.

`oracle` (`Oracle`) is perfect document affinity: every document on one group, chosen
when its first request comes, whatever that does to the load (a hot document's group takes 4x
the mean of requests or more).

`oracle_balanced` (`BalancedOracle`) knows every document's requests and size over the whole
trace, and places under the load bound that `prefix_aware` must keep (max/mean requests per
group at most `cap`). It plans once, before the first request:

- documents in descending order of requests; one that has more than cap x (mean requests per
  group) is split into just enough copies, its requests evenly over them (a hot document asked
  by 20% of 16 groups' requests needs three);
- each document (or copy) goes to the group with the fewest document tokens planned so far
  among those it fits under the cap, so the groups' pools hold the same share of the documents
  (else to the group with the fewest requests planned);
- a document's request goes to its copy with the fewest requests placed so far, and a request
  without a document to the group with the fewest placed.

It answers what static placement by demand and size reaches at the same balance, with no cost
model and no index (figures: benchmarks/RESULTS.md).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence

from benchmarks.traces import TraceRequest
from router.placement.policy import Placement, Policy, cached_blocks
from router.placement.registry import LeastLoaded


class Oracle(Policy):
    """Perfect document affinity, for the routing benchmark: the benchmark names each request's
    document with `expect(key, tokens)`; a document's first request goes to the group with the
    fewest document tokens assigned so far, and every later one follows it. Requests without a
    document go to the least loaded group."""

    name = "oracle"

    def __init__(self, block_size: int = 16) -> None:
        super().__init__(block_size)
        self._home: dict[str, str] = {}
        self._assigned: dict[str, int] = {}
        self._key: tuple[str, int] | None = None
        self._fallback = LeastLoaded(block_size)

    def expect(self, key: str | None, tokens: int = 0) -> None:
        self._key = None if key is None else (key, tokens)

    def choose(self, block_hashes, statuses, matches, placed) -> Placement:
        expected, self._key = self._key, None
        if expected is None:
            return self._fallback.choose(block_hashes, statuses, matches, placed)
        key, tokens = expected
        home = self._home.get(key)
        if home not in statuses:
            home = min(statuses, key=lambda g: (self._assigned.get(g, 0), g))
            self._home[key] = home
            self._assigned[home] = self._assigned.get(home, 0) + tokens
        return Placement(home, self.name, cached_blocks(matches, home))


class BalancedOracle(Oracle):
    """Clairvoyant placement by demand and size under a load bound; see the module docstring."""

    name = "oracle_balanced"

    def __init__(self, homes: dict[str, list[str]], groups: Sequence[str], block_size: int = 16) -> None:  # fmt: skip
        super().__init__(block_size)
        if not groups:
            raise ValueError("groups must not be empty")
        self.homes = homes  # document -> the groups holding a copy of it
        self.placed = Counter(dict.fromkeys(groups, 0))

    @classmethod
    def plan(cls, requests: Iterable[TraceRequest], groups: Sequence[str], cap: float = 1.15, block_size: int = 16) -> BalancedOracle:  # fmt: skip
        """The placement of a trace's documents over `groups`, bounded at `cap` x the mean."""
        if not cap >= 1.0:
            raise ValueError(f"cap must be >= 1, got {cap}")
        if not groups:
            raise ValueError("groups must not be empty")
        asked, size, total = Counter(), {}, 0
        for r in requests:
            total += 1
            if r.doc is not None:
                asked[r.doc] += 1
                size[r.doc] = max(size.get(r.doc, 0), r.doc_tokens)
        bound = cap * total / len(groups)
        tokens, load = dict.fromkeys(groups, 0), dict.fromkeys(groups, 0.0)
        homes: dict[str, list[str]] = {}
        for doc, n in asked.most_common():
            copies = min(len(groups), max(1, math.ceil(n / bound)))
            share, homes[doc] = n / copies, []
            for _ in range(copies):
                free = [g for g in groups if g not in homes[doc]]
                fits = [g for g in free if load[g] + share <= bound]
                if fits:
                    g = min(fits, key=lambda g: (tokens[g], load[g]))
                else:
                    g = min(free, key=lambda g: (load[g], tokens[g]))
                homes[doc].append(g)
                tokens[g] += size[doc]
                load[g] += share
        return cls(homes, groups, block_size)

    def choose(self, block_hashes, statuses, matches, placed) -> Placement:
        expected, self._key = self._key, None
        homes = [g for g in self.homes.get(expected[0], ()) if g in statuses] if expected else []
        gid = min(homes or statuses, key=lambda g: (self.placed[g], g))
        self.placed[gid] += 1
        return Placement(gid, self.name, cached_blocks(matches, gid))
