"""Placement policies: which group gets a request, given the index's matches and the loads.

`prefix_aware` (the default) picks the group with the lowest estimated cost to first token:
the prefill still to compute there (the prompt minus the blocks the group holds or has pending)
on top of the group's queued prefill work, under its running decodes, plus charges for what
the placement costs the rest of the cluster: the recompute (weighted, since a prefix computed
twice also takes pool space twice), the cached blocks it would evict (weighted by how much new
content the group took in lately: little means an old, cold LRU tail), its neighbours' decode
time, and how far the group is above the mean of this router's recent placements. On top of
that, a group over (1 + load_slack) x the mean of recent placements takes no request
(consistent hashing with bounded loads, Mirrokni et al.): a hot document's questions spread
over its holders, and when they are all at the bound the document spills to one more group,
which caches it too. Replication therefore follows load, never more than the bound needs.
The bound's slack goes where diverting costs most: a prefix held by only one or two groups,
all at the bound, may still go to one of them up to (1 + hit_slack) x the mean, since diverting
it recomputes the prefix and keeps a second copy warm; the requests that cost the same anywhere
(new prefixes, chats, a hot document's questions, which have other holders) keep the bound.
Ties go by rendezvous hashing of the chain's first block, so every router replica breaks a tie
the same way.

Measured with benchmarks/routing.py (simulated groups, a Zipf-hot document; 16 groups / 10k
requests, seeds 0 and 1): on the loose trace the hit rate is 0.969 / 0.965 against perfect
document affinity's 0.974 / 0.969, with at most 1.05 / 1.09x the mean requests on any group,
where the affinity oracle and `prefix_hash` put 3.9-4.9x on the hot document's group (64
groups / 100k requests: 0.973 vs 0.977, at 1.09x). On the tight trace (documents twice
the pools) it is 0.929 / 0.922 against `prefix_hash`'s 0.931 / 0.920 and the oracle's 0.934 /
0.924, at 1.06 / 1.09x instead of 4.1-4.4x: the replicas that balance needs take pool space
(the hot document alone is asked 20% of the time, three groups' worth at the bound). Over pools
1% smaller or larger the figures move by up to 0.1 points and stay within 1.10x.
`load_slack=None` with `max_replicas=1` is pure affinity (0.934 there, no balance).

Baselines: `round_robin`, `least_loaded`, `prefix_hash` (rendezvous hashing of the first block)
and `oracle` (perfect document affinity, for the routing benchmark only).
"""

from __future__ import annotations

import hashlib
import itertools
import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields

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
    """The time model behind `prefix_aware` (seconds from the group's calibrated cost model).

    Defaults measured with benchmarks/routing.py on simulated 16-group research-assistant
    traces (two seeds each, loose and tight pools); see the module docstring."""

    cost: CostModel = field(default_factory=CostModel)
    max_num_batched_tokens: int = 2048  # a group's token budget per step
    # Each prompt token a group must compute is charged its prefill time once for this
    # request's wait and recompute_weight times more for what it costs the cluster: every
    # request queued behind it waits too, and a prefix computed where another group holds it
    # takes a second copy of pool space. 0 is the bare TTFT rule (it spills a hot document as
    # soon as its holder's queue costs more than one prefill, and duplicates freely).
    recompute_weight: float = 8.0
    # Each cached block a placement evicts is charged eviction_weight times its recompute,
    # scaled by the group's recent uncached tokens over the mean: a group that took in less
    # new content lately has an older LRU tail, so what it evicts is colder.
    eviction_weight: float = 4.0
    # Most groups a prefix spills onto by cost; None: half the live groups (at least 2). The
    # load bound below may still place a request elsewhere.
    max_replicas: int | None = None
    # Decode steps a request is expected to run: each request already running or waiting on a
    # group slows every step there by cost.decode_seq_s for about that many steps, so a
    # placement is charged request_weight * decode_tokens * decode_seq_s per such request
    # (the time it adds to its neighbours and they add to it). 0 ignores request counts.
    decode_tokens: int = 32
    request_weight: float = 1.0
    # Load balance over this router's last ~balance_window placements per live group
    # (exponentially decayed; the bound's burst is then the same fraction at any group count):
    # each placement a group took above the mean costs balance_weight neighbours' worth of
    # decode time (so a hot document's questions go to its least busy holder), and a group
    # over (1 + load_slack) * mean + load_burst placements takes none until the others catch up
    # (consistent hashing with bounded loads: the hot document then spills to a new replica).
    # Each router bounds its own placements, so several routers together stay bounded too.
    # With the ~200 placements a group holds in the window, the bound is ~1.12x the mean; a
    # burst of 8 (1.14x) let a whole run end at 1.16x on one of the traces at a 1% larger pool.
    # load_slack None: no bound.
    balance_window: int = 200
    balance_weight: float = 1.0
    load_slack: float | None = 0.1
    load_burst: float = 4.0
    # The bound's slack goes where diverting costs most. A request whose longest match is held
    # by at most hit_holders groups, all over the bound, may still go to one of them up to
    # (1 + hit_slack) * mean + load_burst: diverting it recomputes the prefix and stores a
    # second copy that its later requests keep warm. Requests with a cheap elsewhere (new
    # prefixes, chats, a prefix with more holders: a hot document) keep load_slack, so they
    # absorb the excess. 2 covers a prefix that balance already replicated once; a hot
    # document past 2 replicas spills at load_slack.
    # None (or hit_slack <= load_slack): one bound for all.
    hit_slack: float | None = 0.2
    hit_holders: int = 2

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")  # fmt: skip
        for name in ("recompute_weight", "eviction_weight", "request_weight", "balance_weight", "load_burst"):  # fmt: skip
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.decode_tokens < 0:
            raise ValueError(f"decode_tokens must be >= 0, got {self.decode_tokens}")
        if self.max_replicas is not None and self.max_replicas < 1:
            raise ValueError(f"max_replicas must be >= 1, got {self.max_replicas}")
        if self.balance_window < 1:
            raise ValueError(f"balance_window must be >= 1, got {self.balance_window}")
        if self.load_slack is not None and not self.load_slack >= 0:
            raise ValueError(f"load_slack must be >= 0 or None, got {self.load_slack}")
        if self.hit_slack is not None and not self.hit_slack >= 0:
            raise ValueError(f"hit_slack must be >= 0 or None, got {self.hit_slack}")
        if self.hit_holders < 1:
            raise ValueError(f"hit_holders must be >= 1, got {self.hit_holders}")


class PrefixAware(Policy):
    """Lowest estimated cost to first token under a load bound; see the module docstring."""

    name = "prefix_aware"

    def __init__(self, config: PrefixAwareConfig | None = None) -> None:
        self.config = config or PrefixAwareConfig()
        self.window = GroupWindow(self.config.balance_window)  # per live group

    def choose(self, block_hashes, statuses, matches) -> Placement:
        cfg, n, key = self.config, len(block_hashes), _first(block_hashes)
        # One pass over the live groups: hits (`_cached`, inlined), placements, tokens sent.
        requests, tokens, scale = self.window.raw()
        hits, placed, sent, best_hit = {}, {}, {}, 0
        for g in statuses:
            m = matches.get(g)
            if m is None:
                h = 0
            else:
                h = m.blocks if m.blocks > m.pending_blocks else m.pending_blocks
                h = h if h < n else n
                best_hit = h if h > best_hit else best_hit
            hits[g] = h
            placed[g] = requests.get(g, 0.0) * scale
            sent[g] = tokens.get(g, 0.0)
        candidates = list(statuses)
        if best_hit > 0:
            holders = [g for g in statuses if 2 * hits[g] >= best_hit]
            if len(holders) >= (cfg.max_replicas or max(2, len(statuses) // 2)):
                candidates = holders  # replication by cost is bounded: stay on the holders
        mean = sum(placed.values()) / len(placed)
        if cfg.load_slack is not None:
            candidates = self._bounded(candidates, statuses, hits, best_hit, placed, mean)
        scored = self._scores(n, candidates, statuses, hits, sent, placed, mean)
        low = min(scored.values())
        tied = [g for g, v in scored.items() if v == low]  # e.g. idle groups, a new prefix
        gid = tied[0] if len(tied) == 1 else max(tied, key=lambda g: rendezvous(key, g))
        self.window.add(gid, (n - hits[gid]) * self.block_size, len(statuses))
        if best_hit == 0:
            reason = "new_prefix"
        elif hits[gid] == best_hit:
            reason = "prefix_hit"
        else:
            reason = "spill"
        return Placement(gid, reason, hits[gid])

    def _scores(self, n, candidates, statuses, hits, sent, placed, mean) -> dict[str, float]:
        """Each candidate's estimated cost in seconds of this `n`-block prompt: its time to first
        token, plus the charges for recompute, eviction (scaled by the group's pressure: the
        uncached tokens `sent` there lately over the mean), neighbours and balance. One loop
        with the constants hoisted out: at 64 groups it is most of a decision's policy time."""
        cfg, c, bs = self.config, self.config.cost, self.block_size
        prefill_s, step_s, decode_s = c.prefill_token_s, c.step_s, c.decode_seq_s
        budget, half = cfg.max_num_batched_tokens, bs // 2
        recompute_w, eviction_w = cfg.recompute_weight, cfg.eviction_weight
        request_w, decode_tokens = cfg.request_weight, cfg.decode_tokens
        unit = cfg.balance_weight * cfg.decode_tokens * decode_s
        total, live = sum(sent.values()), len(sent)  # pressure 1 for all when nothing was sent
        scored, by_hit = {}, {}  # by_hit: hit blocks -> (new tokens, their blocks, recompute)
        for g in candidates:
            s, h = statuses[g], hits[g]  # h <= n
            if h not in by_hit:
                t = (n - h) * bs + half
                by_hit[h] = (t, math.ceil(t / bs), recompute_w * t * prefill_s)
            new_tokens, new_blocks, recompute = by_hit[h]
            work = s.pending_prefill_tokens + new_tokens
            steps = math.ceil(work / budget)
            ttft = work * prefill_s + steps * (step_s + s.running * decode_s)
            empty = s.blocks_free - s.blocks_cached  # no content, no reference; cached are taken
            evicted = new_blocks - empty if empty > 0 else new_blocks
            evicted = evicted if evicted > 0 else 0
            pressure = sent[g] * live / total if total > 0 else 1.0
            eviction = eviction_w * pressure * evicted * bs * prefill_s
            neighbours = request_w * (s.running + s.waiting) * decode_tokens * decode_s
            scored[g] = ttft + recompute + eviction + neighbours + unit * (placed[g] - mean)
        return scored

    def _bounded(self, candidates, statuses, hits, best_hit, placed, mean) -> list[str]:
        """The candidates under the load bound; the least placed group always is. A prefix's
        only holders (at most hit_holders groups with its longest match), all over the bound,
        stay candidates up to the hit bound: diverting the request would recompute the prefix
        and store a second copy, while the bound is kept by the requests that cost nothing to
        place elsewhere (new prefixes, chats, a prefix with more holders)."""
        cfg = self.config
        bound = (1.0 + cfg.load_slack) * mean + cfg.load_burst
        under = [g for g in candidates if placed[g] < bound]
        if cfg.hit_slack is not None and best_hit > 0:
            best = [g for g in candidates if hits[g] == best_hit]
            if len(best) <= cfg.hit_holders and all(placed[g] >= bound for g in best):
                high = (1.0 + cfg.hit_slack) * mean + cfg.load_burst
                under += [g for g in best if placed[g] < high]
        return under or [g for g in statuses if placed[g] < bound]


class GroupWindow:
    """Each group's part of a router's last ~`window` x (live groups) placements, exponentially
    decayed: the requests placed there and the prompt tokens they sent there uncached.

    Stored values are the decayed ones divided by the product of the decays so far, so a
    placement updates one entry instead of decaying every group's."""

    def __init__(self, window: int) -> None:
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
