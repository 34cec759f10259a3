"""Reference placements for the routing benchmark to measure policies against: two that know the
whole trace, and the cache-aware rule of SGLang's router.

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

Both oracles read each request's document from the trace; on a trace that names none,
`with_documents` derives them from shared leading blocks first.

`cache_aware_threshold` (`CacheAwareThreshold`) is the threshold switch of SGLang's router
(`cache_aware`): affinity to the longest match unless the groups' loads are imbalanced, then
the shortest queue. It knows nothing ahead; it is the field's rule, for the benchmark only.
"""

from __future__ import annotations

import hashlib
import math
from array import array
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import replace

from benchmarks.traces import TraceRequest
from router.placement.policy import Placement, Policy, cached_blocks, first_block, rendezvous
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

    def __init__(self, homes: dict[str, list[str]], groups: Sequence[str], block_size: int = 16) -> None:
        super().__init__(block_size)
        if not groups:
            raise ValueError("groups must not be empty")
        self.homes = homes  # document -> the groups holding a copy of it
        self.placed = Counter(dict.fromkeys(groups, 0))

    @classmethod
    def plan(
        cls, requests: Iterable[TraceRequest], groups: Sequence[str], cap: float = 1.15, block_size: int = 16
    ) -> BalancedOracle:
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


def with_documents(requests: Callable[[], Iterable[TraceRequest]], block_size: int = 16) -> Iterator[TraceRequest]:
    """The requests `requests()` yields (read twice), each one that names no document given one
    derived from shared leading blocks: its longest block-aligned prefix (of one tenant) that
    another request of the trace starts with, named by that prefix's hash. A request that shares
    no whole block keeps none (the oracles place it by load, as a chat); so does a text prompt."""
    seen = Counter(h for r in requests() if r.doc is None for h in _block_chain(r, block_size))
    for r in requests():
        chain = _block_chain(r, block_size) if r.doc is None else []
        shared = next((k for k in range(len(chain), 0, -1) if seen[chain[k - 1]] > 1), 0)
        yield replace(r, doc=f"~{chain[shared - 1].hex()}", doc_tokens=shared * block_size) if shared else r


def _block_chain(r: TraceRequest, block_size: int) -> list[bytes]:
    """Chained hashes of the request's whole blocks before its last token (the engine always
    computes that one), rooted at its tenant."""
    if r.prompt_token_ids is None:
        return []
    data, step = array("I", r.prompt_token_ids).tobytes(), 4 * block_size
    h, chain = (r.tenant or "").encode(), []
    for k in range((len(r.prompt_token_ids) - 1) // block_size):
        h = hashlib.blake2b(h + data[k * step : (k + 1) * step], digest_size=16).digest()
        chain.append(h)
    return chain


class CacheAwareThreshold(Policy):
    """SGLang's router's cache-aware rule (its `cache_aware` policy, with its defaults), on
    this cluster's prefix index:

    - the groups are imbalanced when the most loaded one has more than `balance_abs` requests
      more than the least loaded and more than `balance_rel` times as many (load: requests
      running and waiting, what that router counts in flight); then the least loaded group
      takes the request (the shortest queue);
    - otherwise, if the longest match covers more than `cache_threshold` of the prompt, the
      group holding it takes the request (ties: the less loaded);
    - otherwise the group whose cache took the least (that router's smallest tree; here the
      fewest uncached tokens placed on it lately).

    The match is the index's (exact), where that router keeps an approximate tree of its own
    routes: the rule, not its approximation, is what the benchmark compares."""

    name = "cache_aware_threshold"

    def __init__(
        self, block_size: int = 16, cache_threshold: float = 0.3, balance_abs: int = 64, balance_rel: float = 1.5
    ) -> None:
        super().__init__(block_size)
        if not 0 <= cache_threshold <= 1:
            raise ValueError(f"cache_threshold must be in [0, 1], got {cache_threshold}")
        if balance_abs < 0 or not balance_rel >= 1:
            raise ValueError(f"balance_abs must be >= 0 and balance_rel >= 1, got {balance_abs}, {balance_rel}")
        self.cache_threshold, self.balance_abs, self.balance_rel = cache_threshold, balance_abs, balance_rel

    def choose(self, block_hashes, statuses, matches, placed) -> Placement:
        load = {g: s.running + s.waiting for g, s in statuses.items()}
        key = first_block(block_hashes)

        def least(groups, by) -> str:
            return min(groups, key=lambda g: (by(g), bytes(255 - b for b in rendezvous(key, g))))

        most, fewest = max(load.values()), min(load.values())
        if most - fewest > self.balance_abs and most > self.balance_rel * fewest:
            gid = least(statuses, load.get)
            return Placement(gid, "shortest_queue", cached_blocks(matches, gid))
        hit = {g: cached_blocks(matches, g) for g in statuses}
        best = max(hit.values())
        if block_hashes and best > self.cache_threshold * len(block_hashes):
            gid = least([g for g in statuses if hit[g] == best], load.get)
            return Placement(gid, "prefix_hit", best)
        _, tokens, scale = placed.raw()
        gid = least(statuses, lambda g: tokens.get(g, 0.0) * scale)
        return Placement(gid, "smallest_cache", hit[gid])
